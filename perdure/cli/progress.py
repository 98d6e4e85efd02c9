"""A one-line progress display for long data commands (bytes, documents, tokens/s, ETA).

On a terminal the line is redrawn in place at most every 0.2 s; elsewhere (a log file, CI)
a line is printed at most every 10 s, so logs stay short. It writes to stderr, so a
command's result on stdout stays machine-readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any

MiB = 1 << 20


class ProgressLine:
    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.2 if self.tty else 10.0
        self.start = time.monotonic()
        self.last = 0.0
        self.drawn = False

    def update(self, p: Any) -> None:
        """``p``: a :class:`perdure.data.build.Progress`."""
        now = time.monotonic()
        if not self.enabled or now - self.last < self.every:
            return
        self.last = now
        self._write(format_progress(p, now - self.start))

    def say(self, message: str) -> None:
        self._write(message, keep=True)

    def _write(self, text: str, keep: bool = False) -> None:
        if self.tty and not keep:
            self.stream.write("\r\x1b[2K" + text)
            self.drawn = True
        else:
            if self.drawn:
                self.stream.write("\n")
                self.drawn = False
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def format_progress(p: Any, elapsed: float) -> str:
    frac = p.done_bytes / p.total_bytes if p.total_bytes else 0.0
    rate = p.tokens / elapsed if elapsed > 0 else 0.0
    mbs = p.done_bytes / MiB / elapsed if elapsed > 0 else 0.0
    eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
    return (f"{100 * frac:5.1f}%  {p.done_bytes / MiB:,.1f}/{p.total_bytes / MiB:,.1f} MiB "
            f"({mbs:.1f} MiB/s)  {p.documents:,} documents  {p.tokens:,} tokens "
            f"({rate:,.0f} tokens/s)  ETA {_clock(eta)}")  # fmt: skip


def _clock(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
