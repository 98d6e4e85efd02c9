"""A launcher process imports torch once for all its runs (``launch/zygote_base.py``):
each run's zygote is forked by one base, the task's modules are still imported per run,
and killing the launcher still ends every process it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from perdure.launch import zygote_base
from perdure.launch.procs import child_env
from perdure.launch.zygote import Zygote
from perdure.launch.zygote_base import ForkedZygote, run_zygote

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

ROOT = Path(__file__).resolve().parents[2]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _ready(z: Zygote | None, log: Path) -> Zygote:
    assert z is not None and isinstance(z.proc, ForkedZygote)
    assert z.wait_ready(60), log.read_text() if log.exists() else "no log"
    return z


@pytest.fixture
def own_bases(monkeypatch: pytest.MonkeyPatch):
    """This test's bases only (none left from another test), closed at its end."""
    bases = zygote_base._Bases()
    monkeypatch.setattr(zygote_base, "_BASES", bases)
    yield bases
    for base in bases.by_key.values():
        base.close()


def test_two_runs_fork_their_zygotes_from_one_base(tmp_path: Path, own_bases) -> None:
    env = child_env("token-1")
    a = _ready(run_zygote(env, tmp_path / "a.log", run_dir="a", preload=[]), tmp_path / "a.log")
    b_env = child_env("token-2")  # another run: another token, the same base
    b = _ready(run_zygote(b_env, tmp_path / "b.log", run_dir="b", preload=[]), tmp_path / "b.log")
    try:
        assert a.proc.pid != b.proc.pid  # type: ignore[attr-defined]
        [base] = own_bases.by_key.values()
        assert _parent(a.proc.pid) == _parent(b.proc.pid) == base.proc.pid  # type: ignore[attr-defined]
    finally:
        a.close()
        b.close()
    assert _gone(a.proc.pid) and _gone(b.proc.pid)  # type: ignore[attr-defined]
    assert base.alive  # it waits for the next run


def test_a_task_module_edited_between_runs_is_imported_afresh_by_each_run(
    tmp_path: Path, own_bases, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    mod = tmp_path / "edited_task_mod.py"
    monkeypatch.chdir(tmp_path)
    env = child_env("t")
    seen = []
    for version in (1, 2):
        mod.write_text(
            f"import os\nopen({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
            f"print('edited_task_mod version {version}')\n"
        )
        log = tmp_path / f"z{version}.log"
        z = _ready(run_zygote(env, log, run_dir=None, preload=["edited_task_mod"]), log)
        try:
            assert z.preloaded == ["edited_task_mod"]
            assert f"edited_task_mod version {version}" in log.read_text()
            seen.append(z.proc.pid)  # type: ignore[attr-defined]
        finally:
            z.close()
    [base] = own_bases.by_key.values()
    assert [int(x) for x in pids.read_text().split()] == seen  # never the base's pid
    assert base.proc.pid not in seen


def test_an_idle_base_exits_and_the_next_run_starts_another(
    tmp_path: Path, own_bases, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zygote_base, "BASE_IDLE_S", 0.5)
    env = child_env("t")
    z = _ready(run_zygote(env, tmp_path / "1.log", run_dir=None, preload=[]), tmp_path / "1.log")
    [first] = own_bases.by_key.values()
    z.close()
    first.proc.wait(timeout=20)  # it exits by itself once idle
    z = _ready(run_zygote(env, tmp_path / "2.log", run_dir=None, preload=[]), tmp_path / "2.log")
    try:
        [second] = own_bases.by_key.values()
        assert second.proc.pid != first.proc.pid
        assert _parent(z.proc.pid) == second.proc.pid  # type: ignore[attr-defined]
    finally:
        z.close()


_LAUNCHER = textwrap.dedent(
    """
    import json, socket, sys
    from perdure.launch.procs import child_env
    from perdure.launch.zygote_base import run_zygote
    from perdure.runtime.entry import WorkerSpec
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # a coordinator that never answers: the worker waits
    port = listener.getsockname()[1]
    log = sys.argv[1]
    z = run_zygote(child_env("t"), __import__("pathlib").Path(log), run_dir=None, preload=[])
    assert z is not None and z.wait_ready(60)
    spec = WorkerSpec(name="w", region="r", coordinators=[f"127.0.0.1:{port}"],
                      join_timeout_s=120)
    worker = z.spawn(spec, child_env("t"), __import__("pathlib").Path(log + ".w"))
    base = int(open(f"/proc/{z.proc.pid}/stat").read().rpartition(")")[2].split()[1])
    print(json.dumps({"base": base, "zygote": z.proc.pid, "worker": worker.pid}), flush=True)
    listener.accept()
    """
)


def test_killing_the_launcher_ends_the_base_the_runs_zygote_and_its_worker(
    tmp_path: Path,
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(tmp_path / "z.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert all(not _gone(p) for p in pids.values())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        end = time.monotonic() + 20
        while not all(_gone(p) for p in pids.values()):
            assert time.monotonic() < end, {k: _gone(p) for k, p in pids.items()}
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    for p in pids.values():
        if not _gone(p):  # never reached: the assertion above failed; leave nothing behind
            os.kill(p, signal.SIGKILL)
