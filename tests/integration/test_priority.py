from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from perdure.runtime.member import priority
from perdure.runtime.member.priority import autogroup_nice, normal_priority, thread_ids

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


PROBE = """
import os
from perdure.runtime.member.priority import autogroup_nice, normal_priority, yield_cpu

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
    out = probe(start_new_session=True)
    assert out[:2] == [f"19 19 {os.SCHED_IDLE}", f"0 0 {os.SCHED_OTHER}"]


@linux_root[0]
@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="no sched autogroups")
def test_a_worker_started_from_a_shell_leaves_the_shells_autogroup_alone() -> None:
    """Also where the shell is in no autogroup (the init session's processes, as under a
    container's or CI's runner, read ``/proc/self/autogroup`` as empty)."""
    out = probe(start_new_session=False)
    assert out[0] == f"{autogroup_nice()} 19 {os.SCHED_IDLE}"


def probe(*, start_new_session: bool) -> list[str]:
    """Run PROBE in a child; its stderr is in the failure message."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=start_new_session,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")


@pytest.mark.parametrize(
    ("text", "nice"), [("/autogroup-3649 nice 0\n", 0), ("/autogroup-7 nice 19\n", 19), ("", None)]
)
def test_autogroup_nice_reads_none_for_a_process_in_no_autogroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, nice: int | None
) -> None:
    """The init session's processes read an empty file; niceness then works per thread."""
    (tmp_path / "autogroup").write_text(text)
    monkeypatch.setattr(priority, "AUTOGROUP", tmp_path / "autogroup")
    assert autogroup_nice() == nice
    monkeypatch.setattr(priority, "AUTOGROUP", tmp_path / "absent")
    assert autogroup_nice() is None


def test_a_worker_hands_the_gil_to_a_waiting_thread_within_half_a_millisecond() -> None:
    """The threads on a kill's path (the channel's reader, an overlapped copy's server)
    wait for the GIL while the main thread computes: Python's 5 ms default was theirs to
    wait per hand-over (``priority.SWITCH_S``)."""
    before = sys.getswitchinterval()
    try:
        priority.prompt_threads()
        assert sys.getswitchinterval() == pytest.approx(priority.SWITCH_S) and before >= 0.005
    finally:
        sys.setswitchinterval(before)
