"""``summary.json``: what a run did, in numbers a test or a person can compare."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from perdure.config.run import RunConfig
from perdure.runtime.events import read_jsonl


def write_summary(run_dir: Path, config: RunConfig, *, started: float) -> dict[str, Any]:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    done = [e for e in events if e.get("event") == "worker_done"]
    hashes = sorted({e["final_hash"] for e in done if "final_hash" in e})
    epochs = [e for e in events if e.get("event") == "epoch_started"]
    steps = sorted({m["step"] for m in metrics})
    summary = {
        "steps": len(steps),
        "last_step": steps[-1] if steps else None,
        "wall_s": round(time.time() - started, 3),
        "membership_changes": max(0, len(epochs) - 1),
        "restarts": 0,
        "final_hash": hashes[-1] if len(hashes) == 1 else None,
        "replica_hashes_agree": len(hashes) == 1,
        "decisions": [e for e in events if e.get("event") == "decision"],
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
