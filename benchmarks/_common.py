"""Shared helpers for the benchmark suite: machine description, statistics, process groups.

Not part of perdure: only the benchmark scripts import this module.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
RESULTS = ROOT / "results"
PY = sys.executable

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C (KeyboardInterrupt), so that a benchmark's ``finally``
    blocks run: its processes killed, its network namespaces torn down."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM, torch/python versions: the conditions of every number."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "ram_gib": ram,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "loadavg_at_start": list(os.getloadavg()),
    }


def stats(xs: Sequence[float]) -> dict[str, float] | None:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def ratios(ours: Sequence[float], base: Sequence[float]) -> dict[str, float] | None:
    """Per-repeat ratios ours/base (paired: the same repeat ran both side by side)."""
    return stats([a / b for a, b in zip(ours, base, strict=True) if b])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_group(rank: int, size: int, port: int, prefix: str = "bench", timeout_s: float = 300):
    """A gloo process group on loopback without init_process_group; returns (store, pg)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timedelta(seconds=timeout_s), wait_for_workers=False
    )
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), rank, size, timedelta(seconds=timeout_s)
    )
    return store, pg


def write_result(name: str, data: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def fmt(s: dict[str, float] | None, digits: int = 3) -> str:
    if not s:
        return "-"
    return f"{s['min']:.{digits}f} / {s['median']:.{digits}f} / {s['max']:.{digits}f}"


def ensure_dataset(path: str = "runs/datasets/stdlib", max_mb: float = 10) -> str:
    """Build the stdlib dataset once (the same one the configs name)."""
    full = REPO / path
    if (full / "manifest.json").exists() or (full.exists() and any(full.iterdir())):
        return str(full)
    src = os.path.dirname(os.__file__)
    subprocess.run(
        [
            str(REPO / ".venv/bin/perdure"),
            "data",
            "build",
            src,
            "--include",
            "*.py",
            "--max-mb",
            str(max_mb),
            "--out",
            str(full),
        ],
        check=True,
        cwd=REPO,
    )
    return str(full)


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


class InlineComm:
    """A comm whose thread is the caller's: a reducer's ``finish``/``start`` submits to
    it and the work runs at once (``pg`` None: one member)."""

    def __init__(self, pg: Any = None) -> None:
        self.pg = pg

    def submit(self, fn: Any) -> Any:
        from concurrent.futures import Future

        f: Future[Any] = Future()
        f.set_result(fn())
        return f
