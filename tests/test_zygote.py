from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from perdure.launch.procs import child_env
from perdure.launch.zygote import UNKNOWN_EXIT, ForkedProcess, Zygote

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the zygote forks")


@pytest.fixture
def zygote(tmp_path: Path):
    z = Zygote(child_env("test-token"), tmp_path / "zygote.log")
    end = time.monotonic() + 30
    while not z.ready:
        assert time.monotonic() < end, (tmp_path / "zygote.log").read_text()
        time.sleep(0.05)
    yield z
    z.close()


def _spawn(z: Zygote, argv: list[str], log: Path) -> ForkedProcess:
    p = z.spawn(argv, child_env("test-token"), log)
    assert p is not None
    return p


def test_a_forked_command_writes_its_log_and_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    ok = _spawn(zygote, ["--version"], tmp_path / "v.log")
    assert ok.wait(20) == 0
    assert "perdure, version" in (tmp_path / "v.log").read_text()
    bad = _spawn(zygote, ["config", "check", str(tmp_path / "missing.toml")], tmp_path / "c.log")
    assert bad.wait(20) == 1
    assert "missing.toml" in (tmp_path / "c.log").read_text()


def test_a_killed_child_reports_the_signal_like_popen(zygote: Zygote, tmp_path: Path) -> None:
    with socket.socket() as listener:  # a coordinator that never answers: the worker waits
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        argv = ["worker", "--name", "w", "--region", "r", "--coordinator", f"127.0.0.1:{port}"]
        p = _spawn(zygote, [*argv, "--join-timeout-s", "30"], tmp_path / "w.log")
        time.sleep(0.5)
        assert p.poll() is None
        assert os.getsid(p.pid) == p.pid  # its own session, like start_new_session=True
        assert os.environ.get("PERDURE_RUN_TOKEN") != "test-token"  # env is the child's only
        p.send_signal(signal.SIGKILL)
        assert p.wait(10) == -signal.SIGKILL


def test_spawn_is_refused_once_the_zygote_is_gone(zygote: Zygote, tmp_path: Path) -> None:
    zygote.close()
    assert not zygote.ready
    assert zygote.spawn(["--version"], child_env("t"), tmp_path / "v.log") is None
    assert zygote.exit_code(2**22 + 12345) == UNKNOWN_EXIT
