"""The main job: a four-region run with live faults, and the proof that they changed no bit.

The proof needs a reference: the same config and dataset version with no fault but the
data fault (a poisoned dataset part changes the math through the decision log, so the reference
keeps it). Its summary is cached under ``runs/reference/<key>/`` keyed by the config hash,
the dataset version id and a digest of the code that does the math (perdure's sources and
the task's module: a cached reference from other code would prove nothing), and reused when
present; the demo says which.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from perdure.run_config import RunConfig, config_hash, to_dict, with_overrides


def reference_config(config: RunConfig) -> RunConfig:
    """The same math without the faults that must not change it; on two workers. A kind
    that changes the math through the decision log (``Fault.changes_math``: a poisoned
    shard) is kept."""
    data_faults = [to_dict(f) for f in config.chaos.faults if _changes_math(f.kind)]
    region = config.cluster.regions[0].name
    return with_overrides(
        config,
        chaos={"faults": data_faults},
        cluster={
            "regions": [{"name": region, "workers": 2}],
            "standby_region": None,
            "coordinator_region": None,
        },
    )


def _changes_math(kind: str) -> bool:
    from perdure.chaos import faults

    fault = faults.get(kind)
    return fault is not None and fault.changes_math


def code_digest(entry: str) -> str:
    """SHA-256 over perdure's Python sources and the task's module file."""
    import importlib.util

    import perdure

    root = Path(perdure.__file__).parent
    files = [(str(f.relative_to(root)), f) for f in sorted(root.rglob("*.py"))]
    spec = importlib.util.find_spec(entry.split(":")[0])
    if spec is not None and spec.origin:
        files.append((entry.split(":")[0], Path(spec.origin)))
    h = hashlib.sha256()
    for name, f in files:
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def reference(config: RunConfig, version: str, console: Console) -> tuple[dict[str, Any], str]:
    """(reference summary, 'cached' or 'ran')."""
    from perdure.launch.api import run

    code = code_digest(config.task.entry)
    key = hashlib.sha256(f"{config_hash(config)}|{version}|{code}".encode()).hexdigest()[:16]
    cached = Path("runs/reference") / key / "summary.json"
    if cached.exists():
        return json.loads(cached.read_text()), "cached"
    if cached.parent.exists():  # a reference run that never finished: start it again
        shutil.rmtree(cached.parent)
    console.print("running the fault-free reference (same config and dataset, 2 workers) ...")
    return run(reference_config(config), run_dir=cached.parent, timeout_s=1800), "ran"


def fault_table(summary: dict[str, Any]) -> Table:
    t = Table(title="faults injected and how each was absorbed")
    for col in (
        "class",
        "kind",
        "target",
        "step",
        "detect s",
        "re-plan s",
        "copy s",
        "recover s",
        "steps lost",
        "absorbed",
    ):
        t.add_column(col)
    for f in summary.get("faults", []):
        t.add_row(
            f["class"],
            f["kind"],
            f["target"],
            str(f.get("injected_step")),
            *(_s(f.get(k)) for k in ("detect_s", "replan_s", "state_copy_s", "recover_s")),
            str(f["steps_lost"]),
            "[green]yes[/]" if f["absorbed"] else "[red]no[/]",
        )
    return t


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
