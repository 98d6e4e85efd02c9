"""Append-only JSON-lines logs (events.jsonl, metrics.jsonl) shared by the run's processes.

Each record is written with one ``write`` on a file opened in append mode, so lines from
several processes on one machine interleave whole. Every record carries ``t``, wall-clock
seconds since the epoch, so that a reader can order them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class JsonLines:
    """One append-only JSON-lines file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"t": round(time.time(), 6), **record}, separators=(",", ":")) + "\n"
        data = line.encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn last line is ignored)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Tail:
    """The complete lines appended to a JSON-lines file since the last call (a torn last
    line waits for the next call). Readers that poll a live run use it, so each byte of
    the log is read once. ``from_end``: skip what the file already holds (a run resumed
    in its own directory must not act on the previous run's lines)."""

    def __init__(self, path: str | Path, *, from_end: bool = False) -> None:
        self.path, self.pos = Path(path), 0
        if from_end and self.path.exists():
            self.pos = self.path.stat().st_size

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.pos += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]
