"""The launcher's seams: a Launcher protocol with the local launcher as its first member,
chaos and the live view composed as monitor hooks, and the narrow ClusterControl the
local launcher offers them."""

from __future__ import annotations

import io
import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from perdure.chaos.driver import ChaosDriver
from perdure.launch import local, store_client
from perdure.launch.api import local_launcher
from perdure.launch.base import ClusterControl, Launcher, Roster, WorkerState
from perdure.launch.local import LocalLauncher, Proc
from tests.runtime_support import small_config


def _config(tmp_path: Path, faults: list[dict[str, Any]] | None = None) -> Any:
    return small_config(tmp_path / "data", workers=2, regions=2, chaos={"faults": faults or []})


def test_chaos_is_attached_only_when_the_schedule_has_faults(tmp_path: Path) -> None:
    bare = local_launcher(_config(tmp_path), tmp_path / "a")
    assert bare.hooks == []
    kill = [{"kind": "kill", "target": "r0-0", "at_step": 3}]
    armed = local_launcher(_config(tmp_path, kill), tmp_path / "b")
    assert [type(h) for h in armed.hooks] == [ChaosDriver]
    faces: tuple[Launcher, ClusterControl, Roster] = (armed, armed, armed)  # mypy checks these
    assert all(faces)


@pytest.fixture
def launcher(tmp_path: Path) -> Any:
    la = LocalLauncher(_config(tmp_path), tmp_path / "run")
    procs = {n: subprocess.Popen(["sleep", "60"]) for n in ("r0-0", "r1-0", "coordinator")}
    la.coordinators.append(Proc("coordinator", "r0", "coordinator", procs["coordinator"]))
    for name in ("r0-0", "r1-0"):
        la.procs[name] = Proc(name, name[:2], "worker", procs[name])
    yield la
    for p in procs.values():
        p.kill()
        p.wait()


def test_signals_reach_named_processes_coordinators_included(launcher: Any) -> None:
    assert launcher.processes("r0") == ["r0-0", "coordinator"]
    pid = launcher.procs["r0-0"].popen.pid
    assert launcher.signal("r0-0", signal.SIGKILL, expected_exit=True) == [pid]
    launcher.procs["r0-0"].popen.wait()
    assert launcher.procs["r0-0"].expected_exit is True
    assert launcher.signal("r0-0", signal.SIGKILL) == []  # not alive any more
    assert launcher.processes("r0") == ["coordinator"]
    assert launcher.signal("coordinator", signal.SIGSTOP) == [launcher.coordinators[0].popen.pid]
    assert launcher.signal("nobody", signal.SIGKILL) == []


def test_restart_waits_for_the_old_process_and_a_veto_holds_replacements(
    launcher: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[str, str, int]] = []
    monkeypatch.setattr(launcher, "_start_worker", lambda n, r, gen=0: started.append((n, r, gen)))
    assert launcher.restart("r1-0") is False
    launcher.procs["r1-0"].popen.kill()
    launcher.procs["r1-0"].popen.wait()
    assert launcher.restart("r1-0") is True and started == [("r1-0", "r1", 1)]
    launcher.veto_replacements("r1")
    assert launcher._may_replace("r1-0") is False and launcher._may_replace("r0-0") is True
    launcher.lift_veto("r1")
    assert launcher._may_replace("r1-0") is True


def test_progress_reads_the_steps_committed_since_the_launcher_was_built(launcher: Any) -> None:
    assert launcher.progress().step == -1
    with open(launcher.run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"t": 50.0 + s, "step": s}) + "\n" for s in (0, 1, 2))
    p = launcher.progress()
    assert (p.step, p.first_step_t) == (2, 50.0)
    assert launcher.workers() == [WorkerState("r0-0", "r0", True), WorkerState("r1-0", "r1", True)]
    assert launcher.regions() == ["r0", "r1"]


def test_posting_moves_to_the_standby_store_when_the_primary_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket
    from datetime import timedelta

    from perdure.runtime.control.auth_store import AuthStore
    from perdure.runtime.control.store import StoreServer

    monkeypatch.setattr(store_client, "STORE_TIMEOUT_S", 0.5)
    with socket.socket() as s:  # a port nobody listens on: the primary is gone
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    server = StoreServer("127.0.0.1", 0, "tok")
    live = AuthStore("127.0.0.1", server.port, "tok", timedelta(seconds=5))
    addrs: list[tuple[str, int]] = []
    client = store_client.StoreClient(addrs, "tok")
    try:
        assert client.set("chaos/x", "1") is False  # no coordinator has published its ports
        addrs += [("127.0.0.1", dead), ("127.0.0.1", server.port)]
        assert client.set("chaos/x", "2") is True
        assert live.get("chaos/x") == b"2"
        assert client.set("chaos/x", "3") is True and live.get("chaos/x") == b"3"
    finally:
        server.close()


class _Roster:
    def regions(self) -> list[str]:
        return ["r0", "r1"]

    def workers(self) -> list[WorkerState]:
        return [WorkerState("r0-0", "r0", True), WorkerState("r1-0", "r1", False)]


def test_the_live_view_is_a_hook_over_any_roster(tmp_path: Path) -> None:
    from rich.console import Console

    from perdure.launch.view import LiveView

    out = io.StringIO()
    with LiveView(tmp_path, 10, _Roster(), console=Console(file=out, width=100)) as view:
        view.tick()
        text = "".join(s.text for s in Console(width=100).render(view.render()))
    assert "r0-0 idle" in text and "r1-0 down" in text


class _ExitsOnSecondPoll:
    """A coordinator that exits 0 right after the launcher's first look at it."""

    def __init__(self) -> None:
        self.polls = 0

    def poll(self) -> int | None:
        self.polls += 1
        return None if self.polls == 1 else 0


def test_a_coordinator_exiting_between_two_looks_completes_the_run(tmp_path: Path) -> None:
    la = LocalLauncher(_config(tmp_path), tmp_path / "run")
    la.coordinators.append(Proc("coordinator", "r0", "coordinator", _ExitsOnSecondPoll()))  # type: ignore[arg-type]
    assert la._run_complete() is False  # running: one look, not two
    assert la._run_complete() is True  # exited 0: the run is complete


def test_every_coordinator_gone_with_an_error_names_the_exit_codes(launcher: Any) -> None:
    c = launcher.coordinators[0].popen
    c.kill()
    c.wait()
    with pytest.raises(RuntimeError, match=r"every coordinator is gone .*exit codes \[-9\]"):
        launcher._run_complete()


def test_the_live_view_shows_the_last_evaluation_beside_the_last_step(tmp_path: Path) -> None:
    import json

    from rich.console import Console

    from perdure.launch.view import LiveView

    out = io.StringIO()
    with LiveView(tmp_path, 10, _Roster(), console=Console(file=out, width=120)) as view:
        lines = [{"step": 9, "t": 1.0, "loss": 2.5, "step_s": 0.1, "members": ["r0-0"]},
                 {"eval_step": 9, "t": 1.1, "eval/loss": 2.75, "eval/accuracy": 0.5},
                 {"step": 10, "t": 1.2, "loss": 2.25, "step_s": 0.1}]  # fmt: skip
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        view.tick()
        text = "".join(s.text for s in Console(width=120).render(view.render()))
    assert "loss 2.2500" in text  # the step's line, not the evaluation's
    assert "after step 9: eval/accuracy 0.5000   eval/loss 2.7500" in text


def test_the_live_view_shows_the_tasks_own_metrics_of_the_last_step(tmp_path: Path) -> None:
    import json

    from rich.console import Console

    from perdure.launch.view import LiveView

    out = io.StringIO()
    with LiveView(tmp_path, 10, _Roster(), console=Console(file=out, width=120)) as view:
        lines = [{"step": 8, "t": 1.0, "loss": 2.5, "step_s": 0.1, "train/accuracy": 0.25},
                 {"step": 9, "t": 1.2, "loss": 2.25, "step_s": 0.1, "train/accuracy": 0.625,
                  "train/hits": 5.0}]  # fmt: skip
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        view.tick()
        text = "".join(s.text for s in Console(width=120).render(view.render()))
    assert "train/accuracy 0.6250   train/hits 5.0000" in text


def test_the_local_and_the_ray_launcher_share_the_run_loop_and_override_none_of_it() -> None:
    """Each launcher is the shared loop with a spawner of its own: neither defines any
    method but its constructor, and Ray's is no local launcher (issue 37: a change to the
    local launcher must not silently change Ray's)."""
    from perdure.launch.ray import RayLauncher, RaySpawner
    from perdure.launch.spawner import Spawner
    from perdure.launch.supervisor import Supervisor

    for cls in (LocalLauncher, RayLauncher):
        assert cls.__mro__[1:] == (Supervisor, object)
        own = {k for k, v in vars(cls).items() if callable(v) or isinstance(v, property)}
        assert own == {"__init__"}, cls
    assert not issubclass(RayLauncher, LocalLauncher)
    spawners: tuple[Spawner, Spawner] = (local.LocalSpawner(), RaySpawner(None))  # type: ignore[arg-type]
    protocol = {n for n in vars(Spawner) if not n.startswith("_")}
    assert protocol == {"start_coordinators", "prepare_workers", "start_worker", "tick",
                        "exit_cause", "before_stop", "close"}  # fmt: skip
    for spawner in spawners:
        assert all(callable(getattr(spawner, n)) for n in protocol)
