"""Which process the launcher started under each worker name: ``RUN_DIR/launched.json``.

A worker name is claimed by whoever says it in an authenticated hello. When two live
processes claim one name (a stale process that still holds the run token, a replacement
started while the old process's channel hangs), the coordinator asks this record which of
them the launcher started, and that one keeps the name (``admission.claim``). The
launcher writes it (atomically: a temporary file, then a rename) each time it starts a
worker; the coordinator reads it only when a name is contested.

Limits: only a launcher that starts workers on the coordinator's host (the local one)
writes it, since a pid means nothing on another host; without it, a contested name goes
to the newcomer only once the holder stops heartbeating. Whoever can write the run
directory can write this file: it is as trusted as the checkpoints beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "launched.json"
MAX_BYTES = 1 << 20
"""A record larger than this is not read (it holds one short entry per worker)."""


def record_launched(run_dir: str | Path, name: str, pid: int) -> None:
    """Record that the launcher started ``name`` as process ``pid``."""
    path = Path(run_dir) / FILE
    pids = _read(path)
    pids[name] = pid
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(pids, sort_keys=True))
    os.replace(tmp, path)


def launched_pid(run_dir: str | Path, name: str) -> int | None:
    """The pid the launcher last started under ``name``, or None (no record)."""
    pid = _read(Path(run_dir) / FILE).get(name)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _read(path: Path) -> dict[str, object]:
    try:
        if path.stat().st_size > MAX_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["launched_pid", "record_launched"]
