"""Helpers shared by the runtime tests (no tests here): a small dataset and run configs."""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.data import build_dataset
from perdure.events import read_jsonl
from perdure.launch.api import run
from perdure.run_config import RunConfig, config_from_dict, to_dict

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def build_small_dataset(out: Path) -> Path:
    """About 300 KB of the stdlib's own source, 64-token samples, many small parts."""
    if not (out / "manifest.json").exists():
        build_dataset(
            [str(STDLIB / "json"), str(STDLIB / "email")],
            str(out),
            seq_len=64,
            part_mb=0.05,
            include="*.py",
        )
    return out


def small_config(
    dataset: Path,
    *,
    workers: int = 2,
    regions: int = 1,
    steps: int = 40,
    slots: int = 8,
    batch: int = 16,
    **sections: dict[str, Any],
) -> RunConfig:
    """A tiny_lm run small enough for a test: about 30 ms a step per worker."""
    per = [workers // regions + (1 if i < workers % regions else 0) for i in range(regions)]
    data: dict[str, Any] = {
        "task": {
            "options": {"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.1, "max_len": 128}
        },
        "train": {"steps": steps, "global_batch": batch, "slots": slots},
        "optim": {"warmup_steps": 5},
        "data": {"dataset": str(dataset), "prefetch_steps": 1},
        "cluster": {
            "regions": [{"name": f"r{i}", "workers": n} for i, n in enumerate(per)],
            "replace_after_ms": 300,
            "min_collective_timeout_ms": 3000,
            # Only a spike re-slots work: on a loaded 2-core machine a member is often 2x
            # slower for a moment, and a re-plan the test did not ask for shifts its epochs.
            "slow_ratio": 20.0,
        },
        "checkpoint": {"every_steps": max(1, steps // 2), "keep_last": 5},
    }
    for name, fields in sections.items():
        data.setdefault(name, {}).update(fields)
    return config_from_dict(data)


def sharded_config(
    dataset: Path,
    workers: int,
    k: int,
    *,
    steps: int,
    at_rest: bool = True,
    init: str | None = None,
    **sections: dict[str, Any],
) -> RunConfig:
    """:func:`small_config` with the exact reduction in replica groups of ``k``
    (``at_rest``: parameters sharded between slots too; ``init``: ``task.init``)."""
    train = {"reduction": "exact", "shard_degree": k, "shard_params": at_rest and k > 1}
    train.update(sections.pop("train", {}))
    if init is not None:
        sections["task"] = {"init": init, **sections.get("task", {})}
    return small_config(dataset, workers=workers, steps=steps, train=train, **sections)


def run_to_end(
    config: RunConfig, run_dir: Path, *, resume: str | None = None, timeout_s: float = 90.0
) -> dict[str, Any]:
    return run(config, run_dir=run_dir, resume=resume, timeout_s=timeout_s)


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if kind is None or e["event"] == kind]


_STORY = {
    ev.EPOCH_STARTED: ("epoch", "start_step", "source", "receivers", "reason"),
    ev.LEAVE: ("worker", "reason"),
    ev.PROCESS_EXIT: ("worker", "code", "injected"),
    ev.MEMBER_BENCHED: ("worker",),
    ev.MEMBER_UNBENCHED: ("worker",),
    ev.STEP_ABANDONED: ("worker", "step", "epoch"),
    ev.COLLECTIVE_FAILED: ("worker",),
    ev.SLOTS_SALVAGED: ("worker", "step"),
    ev.STATE_RECEIVED: ("worker", "from", "next_step", "mode"),
    ev.STATE_SENT: ("worker", "next_step", "mode"),
    ev.RECOVERED_FROM_CHECKPOINT: ("checkpoint", "start_step", "live_step"),
    ev.DECISION: ("step", "kind"),
    ev.WORKER_DONE: ("worker", "step", "final_hash"),
}


def story(run_dir: Path) -> str:
    """A run's membership story, one short line an event (epochs, deaths, copies, salvage,
    recoveries, each worker's final hash): what a failed bitwise assertion prints, so
    that a rare failure in a clean-clone CI, whose run directory is gone, can be read."""
    out = [f"run {run_dir}"]
    t0 = None
    for e in events(run_dir):
        keys = _STORY.get(e["event"])
        if keys is None:
            continue
        t0 = e["t"] if t0 is None else t0
        fields = " ".join(f"{k}={e[k]}" for k in keys if e.get(k) is not None)
        out.append(f"{e['t'] - t0:8.3f} {e['event']} {fields}"[:200])
    return "\n".join(out)


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def logged(path: Path, event: str, count: int = 1, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """The records of ``event`` in a live run's merged log, once there are ``count`` of
    them (the coordinator merges the processes' part files every ``runlog.MERGE_S``)."""
    end = time.monotonic() + timeout_s
    while True:
        found = [e for e in read_jsonl(path) if e.get("event") == event]
        if len(found) >= count or time.monotonic() > end:
            return found
        time.sleep(0.02)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    assert isinstance(v, dict), v
    items = [f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None]
    return "{ " + ", ".join(items) + " }"


def write_toml(config: RunConfig, path: Path) -> Path:
    """``config`` as a TOML file (unset fields left out)."""
    lines = []
    for section, fields in to_dict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items() if v is not None]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


OPEN_TRAINERS: list[Any] = []
"""What :func:`step_runner` built (trainers, comms), closed after each test (``conftest``):
their loaders' prefetch threads and comm threads would outlive it (a data test asserts
no prefetch thread is left)."""


def close_trainers() -> None:
    while OPEN_TRAINERS:
        OPEN_TRAINERS.pop().close()


def step_runner(
    config: RunConfig,
    events: list[dict[str, Any]],
    *,
    trainer: Any = None,
    should_stop: Any = None,
    salvage: Any = None,
) -> Any:
    """A one-member ``StepRunner`` in this process (a ``HashStore`` group of one, the
    config's own reducer), its events appended to ``events``: a step's flow without
    processes. ``trainer``, ``should_stop`` (of the step) and ``salvage``: an epoch's
    (default: a new trainer, never, a new salvage)."""
    from datetime import timedelta

    import torch.distributed as dist

    from perdure.runtime.comm.group import Comm
    from perdure.runtime.comm.reducer import make_reducer
    from perdure.runtime.plan import make_plan
    from perdure.runtime.replica.salvage import SlotSalvage
    from perdure.runtime.replica.trainer import Trainer
    from perdure.runtime.step import Seams, SlotTimer, StepRunner

    class Log:
        def write(self, record: dict[str, Any]) -> None:
            events.append(record)

    timeout = timedelta(seconds=30)
    if trainer is None:
        trainer = Trainer(config)
        OPEN_TRAINERS.append(trainer)
    comm = Comm(dist.HashStore(), "t/", 0, 1, timeout, lambda: False)
    OPEN_TRAINERS.append(comm)
    seams = Seams(
        name="w0",
        events=Log(),  # type: ignore[arg-type]
        timeout=lambda: timeout,
        should_stop=should_stop or (lambda t: False),
        evict=lambda w, r: None,
        salvage=salvage if salvage is not None else SlotSalvage(),
    )
    plan = make_plan(["w0"], config.train.slots)
    reducer = make_reducer(config.train, 0, 1)
    return StepRunner(trainer, plan, 0, comm, reducer, seams, SlotTimer())
