"""A run across emulated hosts, started with the documented commands only.

Each host is a network namespace with its own address (``tests/netns_support.py``); the
coordinator, the standby and the workers are ``perdure coordinator ...`` and ``perdure
worker ...`` run through ``ip netns exec``, from a working directory that is not the
repository, with one TOML config for the primary and the standby. The run directory is
a path every namespace sees (the shared storage). Every run must end with the final hash
of the local launcher's run of the same config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from perdure import events as ev
from perdure.events import read_jsonl
from perdure.run_config import RunConfig, to_dict, with_overrides
from tests.netns_support import Hosts, hosts
from tests.runtime_support import run_to_end, small_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHANNEL, STORE = 29400, 29401
STEPS = 120
TOKEN = "multihost-test-token"


def _config(dataset: Path) -> RunConfig:
    return small_config(dataset, workers=3, steps=STEPS, slots=6, batch=12)


@pytest.fixture(scope="module")
def reference(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The local launcher's final hash for the same config."""
    summary = run_to_end(_config(small_dataset), tmp_path_factory.mktemp("mh-ref") / "run")
    assert summary["final_hash"]
    return str(summary["final_hash"])


# -- a config file, as an operator writes it ---------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    assert isinstance(v, dict), v
    items = [f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None]
    return "{ " + ", ".join(items) + " }"


def write_toml(config: RunConfig, path: Path) -> Path:
    """``config`` as a TOML file (unset fields left out)."""
    lines = []
    for section, fields in to_dict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items() if v is not None]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# -- the cluster -------------------------------------------------------------------------


class Cluster:
    """Coordinator on host 0, optionally a standby on host 1, a worker on each of hosts
    1..3, each started as its documented command."""

    def __init__(self, hs: Hosts, tmp: Path, config: RunConfig, *, standby: bool) -> None:
        self.hs, self.tmp = hs, tmp
        self.run_dir = tmp / "shared" / "run"
        self.cwd = tmp / "elsewhere"  # not the repository: hosts start anywhere
        self.cwd.mkdir(parents=True)
        cfg = with_overrides(
            config, cluster={"host": hs[0].address, "channel_port": CHANNEL, "port": STORE}
        )
        self.cfg = write_toml(cfg, tmp / "run.toml")
        self.standby = standby
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PERDURE_RUN_TOKEN": TOKEN,
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }
        self.env.pop("PERDURE_PARENT_PID", None)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _perdure(self, i: int, name: str, *args: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "perdure", *args]
        log = self.tmp / "logs" / f"{name}.log"
        proc = self.hs.start(i, argv, env=self.env, cwd=self.cwd, log=log)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        base = ["coordinator", "--config", str(self.cfg), "--run-dir", str(self.run_dir)]
        self._perdure(0, "coordinator", *base)
        if self.standby:
            self._perdure(1, "standby", *base, "--standby", "--host", self.hs[1].address)
        for i in (1, 2, 3):
            self.worker(i)

    def worker(self, i: int, *extra: str) -> subprocess.Popen[bytes]:
        """``perdure worker`` for r0-<i-1> on host i (again, to replace a dead one)."""
        coords = ["--coordinator", f"{self.hs[0].address}:{CHANNEL}"]
        if self.standby:
            coords += ["--coordinator", f"{self.hs[1].address}:{CHANNEL}"]
        name = f"r0-{i - 1}"
        return self._perdure(i, name, "worker", *coords, "--name", name, "--region", "r0", *extra)

    def steps(self) -> list[int]:
        return [m["step"] for m in read_jsonl(self.run_dir / "metrics.jsonl")]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "events.jsonl") if e["event"] == kind]

    def wait(self, what: str, done: Callable[[], bool], timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.1)

    def wait_step(self, step: int) -> None:
        self.wait(f"step {step}", lambda: max(self.steps(), default=-1) >= step, 90)

    def wait_exits(self, timeout_s: float = 60) -> dict[str, int | None]:
        """Every process started ends by itself (the run ended); their exit codes."""
        self.wait("every process to exit", lambda: all(p.poll() is not None for p in self.live()),
                  timeout_s)  # fmt: skip
        return {n: p.returncode for n, p in self.procs.items()}

    def live(self) -> list[subprocess.Popen[bytes]]:
        return list(self.procs.values())

    def logs(self) -> str:
        out = []
        for log in sorted((self.tmp / "logs").glob("*.log")):
            out.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]))
        return "\n".join(out)

    def summary(self) -> dict[str, Any]:
        path = self.run_dir / "summary.json"
        assert path.exists(), f"no summary.json\n{self.logs()}"
        return dict(json.loads(path.read_text()))


@pytest.fixture
def cluster_of(tmp_path: Path, small_dataset: Path) -> Iterator[Callable[[bool], Cluster]]:
    with hosts(4) as hs:
        yield lambda standby: Cluster(hs, tmp_path, _config(small_dataset), standby=standby)


def _ends_like_the_reference(c: Cluster, reference: str) -> dict[str, Any]:
    summary = c.summary()
    assert summary["final_hash"] == reference, c.logs()
    steps = c.steps()
    assert sorted(steps) == list(range(STEPS))  # every step committed once
    return summary


# -- the runs ----------------------------------------------------------------------------


def test_a_run_across_four_hosts_ends_bitwise_equal_to_the_local_run(
    cluster_of: Callable[[bool], Cluster], reference: str
) -> None:
    c = cluster_of(True)
    c.start()
    c.wait_step(5)
    for i in range(4):  # every listener of every host is on that host's address only
        found = c.hs.listeners(i)
        assert found and [a for a in found if not a.startswith(f"{c.hs[i].address}:")] == []
    assert f"{c.hs[0].address}:{CHANNEL}" in c.hs.listeners(0)
    assert f"{c.hs[0].address}:{STORE}" in c.hs.listeners(0)
    codes = c.wait_exits()
    assert codes == {"coordinator": 0, "standby": 0, "r0-0": 0, "r0-1": 0, "r0-2": 0}, c.logs()
    _ends_like_the_reference(c, reference)
    assert (c.run_dir / "report.html").exists()  # written by the coordinator
    assert not c.events(ev.COORDINATOR_TAKEOVER)


def test_a_worker_killed_on_its_host_and_started_again_changes_no_bit(
    cluster_of: Callable[[bool], Cluster], reference: str
) -> None:
    c = cluster_of(False)
    c.start()
    c.wait_step(20)
    c.procs["r0-2"].send_signal(signal.SIGKILL)
    c.wait("the kill to be seen", lambda: any(e["worker"] == "r0-2" for e in c.events(ev.LEAVE)))
    c.worker(3)  # what a cluster manager does: the same command again
    codes = c.wait_exits()
    assert codes["coordinator"] == 0 and codes["r0-0"] == codes["r0-1"] == 0, c.logs()
    _ends_like_the_reference(c, reference)
    joins = [e for e in c.events(ev.JOIN) if e["worker"] == "r0-2"]
    assert len(joins) == 2  # the replacement rejoined


def test_a_short_link_loss_is_absorbed_without_evicting_anyone(
    cluster_of: Callable[[bool], Cluster], reference: str
) -> None:
    c = cluster_of(False)
    c.start()
    c.wait_step(20)
    c.hs.link_down(3)
    time.sleep(2.0)
    c.hs.link_up(3)
    codes = c.wait_exits()
    assert set(codes.values()) == {0}, c.logs()
    _ends_like_the_reference(c, reference)
    assert c.events(ev.LEAVE) == []


def test_a_long_link_loss_evicts_the_worker_and_the_run_goes_on(
    cluster_of: Callable[[bool], Cluster], reference: str
) -> None:
    c = cluster_of(False)
    c.start()
    c.wait_step(20)
    c.hs.link_down(3)
    c.wait("the eviction", lambda: any(e["worker"] == "r0-2" for e in c.events(ev.LEAVE)), 30)
    at = max(c.steps())
    c.wait_step(at + 10)  # the others train on without it, while its link is still down
    c.hs.link_up(3)
    codes = c.wait_exits(90)
    assert codes["coordinator"] == 0 and codes["r0-0"] == codes["r0-1"] == 0, c.logs()
    assert codes["r0-2"] == 0, c.logs()  # back: rejoined, or found the run over
    (leave,) = [e for e in c.events(ev.LEAVE) if e["worker"] == "r0-2"]
    assert leave["reason"].startswith("phi >")
    _ends_like_the_reference(c, reference)


def test_the_coordinators_host_lost_mid_run_the_standby_finishes_it_bitwise_equal(
    cluster_of: Callable[[bool], Cluster], reference: str
) -> None:
    c = cluster_of(True)
    c.start()
    c.wait_step(20)
    assert c.hs.kill_host(0)  # the coordinator's host: every process on it
    codes = c.wait_exits(90)
    assert codes["standby"] == 0 and {codes[f"r0-{i}"] for i in range(3)} == {0}, c.logs()
    assert codes["coordinator"] == -signal.SIGKILL
    summary = c.summary()  # summary.json: by the standby
    assert summary["final_hash"] == reference, c.logs()
    steps = c.steps()
    assert len(steps) == len(set(steps)) and set(steps) <= set(range(STEPS))
    # Known gap (to fix): only rank 0 writes a step's metrics line, so a step the other
    # members committed while rank 0 abandoned it (its coordinator lost mid-step) has no
    # line. Any missing step must be exactly such a step; every other step appears once.
    abandoned = c.events(ev.STEP_ABANDONED)
    for missing in set(range(STEPS)) - set(steps):
        by = {e["worker"] for e in abandoned if e["step"] == missing}
        assert by == {"r0-0"}, (missing, abandoned)
    assert len(c.events(ev.COORDINATOR_TAKEOVER)) == 1
    assert summary["replica_hashes_agree"]


def test_a_loopback_data_plane_mixed_with_remote_hosts_is_refused_with_the_reason(
    cluster_of: Callable[[bool], Cluster],
) -> None:
    c = cluster_of(False)
    base = ["coordinator", "--config", str(c.cfg), "--run-dir", str(c.run_dir)]
    c._perdure(0, "coordinator", *base)
    at = f"{c.hs[0].address}:{CHANNEL}"
    # a worker on the coordinator's host told to use loopback, then one on another host
    c._perdure(0, "r0-0", "worker", "--coordinator", at, "--name", "r0-0", "--region", "r0",
               "--host", "127.0.0.1")  # fmt: skip
    c.wait("r0-0 to join", lambda: any(e["worker"] == "r0-0" for e in c.events(ev.JOIN)))
    remote = c.worker(2)
    assert remote.wait(60) == 1
    log = (c.tmp / "logs" / "r0-1.log").read_text()
    assert (
        "worker r0-0 listens for its peers on the loopback address 127.0.0.1, which r0-1 at "
        f"{c.hs[2].address} cannot reach" in log
    ), log
    # the coordinator's own record reaches events.jsonl at its next log merge (50 ms)
    c.wait("the refusal in the merged log", lambda: bool(c.events(ev.REFUSED)), 10)
    (refused,) = c.events(ev.REFUSED)
    assert refused["worker"] == "r0-1" and "loopback" in refused["reason"]
