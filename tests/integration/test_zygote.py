from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.launch.procs import child_env
from perdure.launch.zygote import UNKNOWN_EXIT, ForkedProcess, Zygote
from perdure.launch.zygote_base import ForkedZygote, run_zygote
from perdure.runtime.entry import WorkerSpec

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the zygote forks")


@pytest.fixture(params=["own", "from_base"])
def zygote(request: pytest.FixtureRequest, tmp_path: Path):
    """A zygote started on its own, and one forked by this process's base
    (``zygote_base.py``): the launcher cannot tell them apart."""
    env, log = child_env("test-token"), tmp_path / "zygote.log"
    z = run_zygote(env, log, run_dir=None, preload=[]) if request.param == "from_base" else None
    z = z or Zygote(env, log)
    assert isinstance(z.proc, ForkedZygote) == (request.param == "from_base")
    end = time.monotonic() + 30
    while not z.ready:
        assert time.monotonic() < end, (tmp_path / "zygote.log").read_text()
        time.sleep(0.05)
    yield z
    z.close()


def _spec(port: int, timeout_s: float) -> WorkerSpec:
    return WorkerSpec(
        name="w", region="r", coordinators=[f"127.0.0.1:{port}"], join_timeout_s=timeout_s
    )


def _spawn(z: Zygote, spec: WorkerSpec, log: Path) -> ForkedProcess:
    p = z.spawn(spec, child_env("test-token"), log)
    assert p is not None
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_forked_worker_writes_its_log_and_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    p = _spawn(zygote, _spec(_free_port(), 0.5), tmp_path / "w.log")  # nobody listens there
    assert p.wait(20) == 1
    assert "no coordinator reachable" in (tmp_path / "w.log").read_text()


def _python(code: str) -> str:
    """What ``code`` prints in a fresh interpreter (which it must leave with 0)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_what_the_zygote_preloads_does_not_import_the_cli() -> None:
    code = (
        "import sys, perdure.launch.zygote as z, perdure.runtime.entry, perdure.runtime.worker;"
        "print(sorted(m for m in sys.modules if m.startswith('perdure.cli')))"
    )
    assert _python(code) == "[]"


def test_every_reducer_a_member_builds_is_imported_by_the_zygote() -> None:
    """A spare promoted after a kill builds its first reducer on the kill's critical path:
    a module imported there (compiled, where no bytecode is cached) cost it 0.015-0.03 s."""
    code = (
        "import sys; from perdure.launch.zygote import import_runtime; import_runtime()\n"
        "from perdure.runtime.config import TrainConfig\n"
        "from perdure.runtime.comm.reducer import make_reducer\n"
        "before = set(sys.modules)\n"
        "for red, exps, bits in [('chain', 'step', 32), ('exact', 'step', 32),\n"
        "                        ('exact', 'carried', 64), ('exact', 'streamed', 32)]:\n"
        "    train = TrainConfig(reduction=red, reduction_exponents=exps, reduction_bits=bits)\n"
        "    make_reducer(train, 0, 2)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('perdure')))"
    )
    assert _python(code) == "[]"


def test_a_fork_of_the_zygote_starts_no_process_for_its_provenance() -> None:
    """``platform.platform()`` ran ``uname -p`` in a subprocess at each start (a
    replacement's beside the members): answered once in the zygote, its forks inherit
    the answer."""
    code = (
        "import os, subprocess, sys; from perdure.launch.zygote import import_runtime\n"
        "import_runtime()\n"
        "started = []\n"
        "init = subprocess.Popen.__init__\n"
        "def spy(self, *a, **k):\n"
        "    started.append(a[0] if a else k.get('args'))\n"
        "    init(self, *a, **k)\n"
        "subprocess.Popen.__init__ = spy\n"
        "before = set(sys.modules)\n"
        "from perdure.provenance import library_versions\n"
        "library_versions()\n"
        "'localhost'.encode('idna')  # a connect by host name\n"
        "print(started, sorted(set(sys.modules) - before))"
    )
    assert _python(code) == "[] []"


def test_the_zygote_forks_with_every_object_it_holds_frozen() -> None:
    """A worker's collections never traverse (so never copy) the zygote's objects."""
    code = (
        "import gc, json, os, perdure.launch.zygote as z\n"
        "seen = []\n"
        "def fork():\n"
        "    seen.append(gc.get_freeze_count())\n"
        "    return 1  # the parent's side: no child\n"
        "os.fork = fork\n"
        "before = gc.get_freeze_count()\n"
        "z._fork({})\n"
        "print(json.dumps([before, seen[0], len(gc.get_objects())]))"
    )
    before, at_fork, tracked = json.loads(_python(code))
    assert before == 0 and at_fork > 10_000 and tracked < at_fork / 10


def test_a_killed_child_reports_the_signal_like_popen(zygote: Zygote, tmp_path: Path) -> None:
    with socket.socket() as listener:  # a coordinator that never answers: the worker waits
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        p = _spawn(zygote, _spec(port, 30), tmp_path / "w.log")
        time.sleep(0.5)
        assert p.poll() is None
        assert os.getsid(p.pid) == p.pid  # its own session, like start_new_session=True
        assert os.environ.get("PERDURE_RUN_TOKEN") != "test-token"  # env is the child's only
        p.send_signal(signal.SIGKILL)
        assert p.wait(10) == -signal.SIGKILL


def test_spawn_is_refused_once_the_zygote_is_gone(zygote: Zygote, tmp_path: Path) -> None:
    zygote.close()
    assert not zygote.ready
    assert zygote.spawn(_spec(1, 1), child_env("t"), tmp_path / "v.log") is None
    assert zygote.exit_code(2**22 + 12345) == UNKNOWN_EXIT


def test_a_task_module_that_fails_to_import_is_logged_and_the_zygote_still_serves(
    tmp_path: Path,
) -> None:
    z = Zygote(child_env("t"), tmp_path / "z.log", preload=["json", "no_such_task_module_xyz"])
    try:
        assert z.wait_ready(60), (tmp_path / "z.log").read_text()
        assert z.preloaded == ["json"]
        log = (tmp_path / "z.log").read_text()
        assert "could not preload 'no_such_task_module_xyz'" in log
        assert "ModuleNotFoundError" in log
        p = _spawn(z, _spec(_free_port(), 0.5), tmp_path / "w.log")
        assert p.wait(20) == 1  # it forks as before: the workers report the import themselves
    finally:
        z.close()


def test_a_forked_command_runs_the_perdure_cli_and_reports_its_exit(
    zygote: Zygote, tmp_path: Path
) -> None:
    """The local launcher forks the run's coordinators from the zygote (``spawn_command``)."""
    ok = zygote.spawn_command(["coordinator", "--help"], child_env("t"), tmp_path / "c.log")
    bad = zygote.spawn_command(
        ["coordinator", "--no-such-flag"], child_env("t"), tmp_path / "b.log"
    )
    assert ok is not None and bad is not None
    assert (ok.wait(30), bad.wait(30)) == (0, 2)  # click's usage error
    assert "Run a coordinator" in (tmp_path / "c.log").read_text()
    assert "No such option '--no-such-flag'" in (tmp_path / "b.log").read_text()
