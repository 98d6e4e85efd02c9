"""``summary.json``: what a run did, in numbers a test or a person can compare.

Two views of what went wrong: ``faults``, one row per fault the chaos schedule injected
(``chaos/summary.py``), and ``failures``, every failure the log shows, scheduled or not,
each detected and absorbed or not (``chaos/observed.py``), with ``survivor_restarts``:
surviving processes a failure forced to start again (0 by design; a dead worker's
replacement is not one)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.chaos.observed import failure_totals, observed_failures
from perdure.chaos.summary import fault_report, goodput, totals
from perdure.events import read_jsonl
from perdure.run_config import RunConfig

log = logging.getLogger("perdure.launch")


def write_summary(
    run_dir: Path, config: RunConfig, *, started: float, generation: int | None = None
) -> dict[str, Any]:
    """Summarise this launch's logs into ``summary.json``. ``generation``: the coordinator
    generation the summary speaks for (default: the one whose ``run_end`` ended the run);
    a summary for a generation the run directory's fence has left behind is refused
    (:class:`~perdure.runtime.control.fence.Fenced`): an old primary cannot rewrite it."""
    from perdure.runtime.control.fence import Fence

    # this launch only: a run resumed in its own directory appends to the previous logs
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("t", started) >= started]
    if generation is None:
        ends = [e for e in events if e.get("event") == ev.RUN_END and "generation" in e]
        generation = int(ends[-1]["generation"]) if ends else None
    if generation is not None:
        Fence(run_dir).check(generation, "summary")
    metrics = [
        m
        for m in read_jsonl(run_dir / "metrics.jsonl")
        if m.get("t", started) >= started and isinstance(m.get("step"), int)  # not evals
    ]
    done = [e for e in events if e.get("event") == ev.WORKER_DONE]
    hashes = sorted({e["final_hash"] for e in done if "final_hash" in e})
    epochs = [e for e in events if e.get("event") == ev.EPOCH_STARTED]
    steps = sorted({m["step"] for m in metrics})
    faults = fault_report(events, metrics)
    failures = observed_failures(events, metrics)
    summary = {
        "steps": len(steps),
        "last_step": steps[-1] if steps else None,
        "wall_s": round(time.time() - started, 3),
        "membership_changes": _membership_changes(epochs),
        "final_hash": hashes[-1] if len(hashes) == 1 else None,
        "replica_hashes_agree": len(hashes) == 1,
        "decisions": [e for e in events if e.get("event") == ev.DECISION],
        "faults": faults,
        **totals(faults),
        "failures": failures,
        **failure_totals(failures),
        "goodput": goodput(metrics),
        "generation": generation,
    }
    _write(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _membership_changes(epochs: list[dict[str, Any]]) -> int:
    """Epochs whose member set differs from the previous one (re-plans are not counted)."""
    sets = [frozenset(e["plan"]["members"]) for e in epochs]
    return sum(1 for a, b in itertools.pairwise(sets) if a != b)


def _write(path: Path, text: str) -> None:
    """Whole or not at all (a temporary name, then a rename); a failure (disk full) is one
    line on stderr: the summary is still returned to the caller."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        log.error("%s: %s; the summary was not written", path, e.strerror or e)
