"""CPU priority of a worker that starts while others train on the same machine.

A replacement worker's start-up (Python, ``import torch``, building the model) takes
seconds of CPU; on a shared machine it should take only what the training members leave
idle, then compete normally once it is ready. Three Linux details make a plain ``nice``
insufficient, and all are handled here:

- With ``sched_autogroup`` (the default on desktop and many cloud kernels), every session
  is its own scheduling group, and ``nice`` only ranks threads *within* a group. Workers are
  started in their own sessions, so the group's nice (``/proc/self/autogroup``) must be set.
- The nice value is per thread: threads started while niced inherit it, and resetting the
  calling thread alone leaves them (the control channel's reader, gloo's) at the lowest
  priority, where one of them in the reduction path slows every step of every member.
- A niced thread that got a CPU keeps it for its slice (a few ms) before a waking
  normal thread preempts it; a training step wakes on every received chunk, and measured
  steps 15-20% slower while a niced replacement started. ``SCHED_IDLE`` threads are
  preempted at once by any normal thread's wakeup, so the start-up runs under that policy.

Lowering niceness again needs root or CAP_SYS_NICE; without it the worker stays niced (a
warning), runs slower, and the planner gives it fewer slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

LOWEST = 19
SWITCH_S = 0.0005
"""A worker's interpreter switch interval (Python's default: 5 ms). The main thread computes
slots and holds the GIL between kernels; the threads a kill's path runs through (the
control channel's reader, which learns of the new epoch; an overlapped copy's server,
which resumes after each wait on the wire; the heartbeat) each waited up to the interval
for it. Only a thread that waits for the GIL makes the holder switch, so an idle process
pays nothing for it."""
AUTOGROUP = Path("/proc/self/autogroup")


def prompt_threads() -> None:
    """Hand the GIL to a waiting thread within :data:`SWITCH_S` (a worker, at its start)."""
    sys.setswitchinterval(SWITCH_S)


def yield_cpu() -> None:
    """Take the lowest CPU priority (before start-up work)."""
    _set(LOWEST, getattr(os, "SCHED_IDLE", None))


def normal_priority() -> None:
    """Back to normal priority, for every thread and the autogroup."""
    _set(0, getattr(os, "SCHED_OTHER", None))


def _set(nice: int, policy: int | None) -> None:
    try:
        _set_autogroup(nice)
        for tid in thread_ids():
            _set_thread(tid, nice, policy)
    except PermissionError:
        log.warning("could not set CPU priority to nice %d (needs CAP_SYS_NICE)", nice)
    except OSError as e:  # a sandbox without the calls (EINVAL, ENOSYS): run as we are
        log.warning("could not set CPU priority to nice %d: %s", nice, e)


def _set_thread(tid: int, nice: int, policy: int | None) -> None:
    with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
        if policy is not None:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, nice)


def autogroup_nice() -> int | None:
    """This process's autogroup nice, or None when it is in no autogroup: no
    ``sched_autogroup``, or the init session's processes and a cpu cgroup's, which the
    kernel schedules in their task group and whose ``/proc/self/autogroup`` reads empty."""
    try:
        text = AUTOGROUP.read_text()
    except OSError:
        return None
    _, sep, value = text.rpartition("nice")
    return int(value) if sep else None


def _set_autogroup(nice: int) -> None:
    """Only a session leader's autogroup is its own: a worker started from a shell shares
    the shell's, which must not be niced."""
    if os.getsid(0) != os.getpid() or autogroup_nice() is None:
        return
    try:
        AUTOGROUP.write_text(f"{nice}\n")
    except OSError as e:
        if isinstance(e, PermissionError):
            raise
        log.debug("autogroup nice not set: %s", e)


def thread_ids() -> list[int]:
    """This process's thread ids (Linux), or just the calling thread elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
