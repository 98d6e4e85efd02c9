from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from perdure.runtime.priority import normal_priority, thread_ids

linux_root = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice is Linux's"),
    pytest.mark.skipif(os.geteuid() != 0, reason="lowering niceness needs root or CAP_SYS_NICE"),
]


@linux_root[0]
@linux_root[1]
def test_normal_priority_resets_threads_started_while_niced() -> None:
    """A replacement worker starts niced; threads it started before it was ready must not
    stay at the lowest priority (they slowed every step of every member when they did)."""
    main = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, main)
    os.setpriority(os.PRIO_PROCESS, main, 19)
    os.sched_setscheduler(main, os.SCHED_IDLE, os.sched_param(0))
    stop = threading.Event()
    started = threading.Event()
    tids: list[int] = []

    def body() -> None:
        tids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    t = threading.Thread(target=body, daemon=True)
    try:
        t.start()
        assert started.wait(10)
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 19  # inherited from its creator
        assert os.sched_getscheduler(tids[0]) == os.SCHED_IDLE
        assert tids[0] in thread_ids()
        normal_priority()
        assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 0
        assert os.getpriority(os.PRIO_PROCESS, main) == 0
        assert os.sched_getscheduler(tids[0]) == os.sched_getscheduler(main) == os.SCHED_OTHER
    finally:
        stop.set()
        t.join(10)
        os.sched_setscheduler(main, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, main, before)


def autogroup_nice() -> int:
    return int(Path("/proc/self/autogroup").read_text().split("nice")[-1])


PROBE = """
import os
from pathlib import Path
from perdure.runtime.priority import normal_priority, yield_cpu

def autogroup_nice():
    return int(Path("/proc/self/autogroup").read_text().split("nice")[-1])

yield_cpu()
print(autogroup_nice(), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
normal_priority()
print(autogroup_nice(), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
"""


@linux_root[0]
@linux_root[1]
@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no sched autogroups")
def test_a_worker_in_its_own_session_yields_through_its_autogroup() -> None:
    """Under sched_autogroup every session competes as one group whatever its threads' nice
    values: a replacement in its own session must nice its autogroup to yield the CPU."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        check=True,
    ).stdout.split("\n")
    assert out[:2] == [f"19 19 {os.SCHED_IDLE}", f"0 0 {os.SCHED_OTHER}"]


@linux_root[0]
@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no sched autogroups")
def test_a_worker_started_from_a_shell_leaves_the_shells_autogroup_alone() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[0] == f"{autogroup_nice()} 19 {os.SCHED_IDLE}"
