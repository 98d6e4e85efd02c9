"""Processes of a run end with the run: a child dies with the process that started it.

The local launcher starts the coordinators and the zygote, and the zygote forks every
worker; each of them asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to be killed
when its parent goes, whatever killed the parent (SIGKILL included, which no handler sees).
So killing the launcher ends the zygote, which ends the workers: no orphan trains on.

The parent's pid travels in ``PERDURE_PARENT_PID``: a child that finds another parent
(the launcher died before the request took effect) exits at once. Linux only; elsewhere
this is a no-op and the launcher's own shutdown is the only guard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "PERDURE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> bool:
    """Ask to be SIGKILLed when the parent process exits; exit now if it already has.
    ``parent``: the expected parent pid (default: ``$PERDURE_PARENT_PID``). With neither,
    nothing is done: a process an operator started by hand must outlive its shell.
    Returns whether the request was made."""
    expected = parent if parent is not None else _env_parent()
    if expected is None or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != expected:
        os._exit(1)  # the parent died before the request: nobody would ever stop us
    return True


def running(pid: int) -> bool:
    """Whether process ``pid`` is alive and not a zombie waiting to be reaped (Linux's
    ``/proc``; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _env_parent() -> int | None:
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None
