"""The Ray launcher on a real multi-node Ray cluster on this machine (``tests/ray_support``):
a head in region r0 and two raylets in region r1, shared by the module's tests.

Every run here must end with the local launcher's final hash, through a killed worker
process, a killed worker actor and a killed node, and leave no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from perdure import events as ev
from perdure.config.errors import ConfigError
from perdure.launch.api import run
from perdure.run_config import RunConfig, to_dict, with_overrides
from tests.runtime_support import events, run_to_end, small_config

pytest.importorskip("ray", reason="the Ray launcher's tests need Ray: pip install 'perdure[ray]'")

from tests.ray_support import LocalRayCluster, local_ray_cluster, write_toml

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the local Ray cluster fixture reads /proc"
    ),
    pytest.mark.slow,
    # The first test also pays for the module's cluster (~5 s idle, ~25 s on a loaded
    # 2-core machine) and the local reference run; a replacement needs its actor
    # restarted and its fork server's imports (5-22 s here, hence 300 steps).
    pytest.mark.timeout(300),
]

STEPS = 300
TIMEOUT_S = 200.0
"""A Ray run here: ~10 s of Ray start-up (actors, fork servers) on an idle machine; the
bars are on the bits and the events, never on the time."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with local_ray_cluster() as c:
        yield c


def _config(dataset: Path, **sections: dict[str, Any]) -> RunConfig:
    """Three workers: two in r0 (the head), one in r1 (either raylet)."""
    return small_config(dataset, workers=3, regions=2, steps=STEPS, **sections)


@pytest.fixture(scope="module")
def reference(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same run with the local launcher: the hash every Ray run must end with (its
    summary, and its run directory under ``_run_dir``)."""
    rd = tmp_path_factory.mktemp("local") / "run"
    return {**run_to_end(_config(small_dataset), rd), "_run_dir": rd}


def _on_ray(config: RunConfig, run_dir: Path, cluster: LocalRayCluster) -> dict[str, Any]:
    return run(config, run_dir=run_dir, timeout_s=TIMEOUT_S, launcher="ray",
               ray_address=cluster.address)  # fmt: skip


def _placed(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in events(run_dir, ev.PROCESS_PLACED) if e["worker"] == name]


def _at_step(run_dir: Path, step: int, action: Callable[[], None]) -> threading.Thread:
    """Run ``action`` once ``metrics.jsonl`` shows ``step`` committed (a thread)."""

    def watch() -> None:
        metrics = run_dir / "metrics.jsonl"
        end = time.monotonic() + TIMEOUT_S
        while time.monotonic() < end:
            if metrics.exists() and len(metrics.read_text().splitlines()) > step:
                action()
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _assert_logs_merged(run_dir: Path, steps: int) -> None:
    """Every record of every process's event part file is in the merged log exactly once
    (the driver's last merge after every process stopped); every member logs the steps it
    commits, and the merged metrics keep one of those lines per step, each step once."""

    def lines(log: str) -> list[str]:
        return [line for p in sorted((run_dir / f"{log}.d").glob("*.jsonl"))
                for line in p.read_text().splitlines()]  # fmt: skip

    merged = (run_dir / "events.jsonl").read_text().splitlines()
    assert Counter(merged) == Counter(lines("events")), "events.jsonl is not its parts' merge"
    metrics = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert set(metrics) <= set(lines("metrics")), "a metrics line that no member wrote"
    committed = [json.loads(line)["step"] for line in metrics]
    assert committed == list(range(steps))


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


# -- without a run ----------------------------------------------------------------------


def test_a_region_the_cluster_lacks_is_refused_before_anything_starts(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path
) -> None:
    cfg = with_overrides(
        _config(small_dataset),
        cluster={"regions": [{"name": "r0", "workers": 1}, {"name": "eu_west", "workers": 1}]},
    )
    with pytest.raises(ConfigError) as e:
        _on_ray(cfg, tmp_path / "run", cluster)
    text = str(e.value)
    assert "region:eu_west" in text and "ray start --resources" in text, text
    assert not (tmp_path / "run").exists()  # a refusal leaves nothing


def test_a_bad_ray_address_is_refused_naming_the_field(small_dataset: Path) -> None:
    with pytest.raises(ConfigError, match=r"ray\.address: must be HOST:PORT"):
        with_overrides(_config(small_dataset), ray={"address": "no port here"})


# -- runs -------------------------------------------------------------------------------


def test_perdure_run_on_ray_ends_bitwise_equal_to_the_local_launcher(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """``perdure run CFG --launcher ray --ray-address ADDR``: the same final hash, the same
    summary fields and event kinds as the local run, every process in its region, a
    standby (in r1) that ends with the run, and the logs of every process merged."""
    cfg = with_overrides(_config(small_dataset), cluster={"standby_region": "r1"})
    cfg_file = write_toml(to_dict(cfg), tmp_path / "run.toml")
    rd = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "perdure", "run", str(cfg_file), "--run-dir", str(rd),
         "--launcher", "ray", "--ray-address", cluster.address, "--no-live",
         "--timeout-s", str(TIMEOUT_S)],
        capture_output=True, timeout=TIMEOUT_S + 60, env={**os.environ, **cluster.env()},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    summary = json.loads(out.stdout)
    assert summary["final_hash"] == reference["final_hash"]
    assert summary["steps"] == STEPS and summary["survivor_restarts"] == 0
    assert summary.keys() == reference.keys() - {"_run_dir"}
    assert json.loads((rd / "summary.json").read_text())["final_hash"] == summary["final_hash"]
    local_kinds = {e["event"] for e in events(reference["_run_dir"])} | {ev.PROCESS_PLACED}
    assert {e["event"] for e in events(rd)} <= local_kinds
    named = [("coordinator", "r0"), ("standby", "r1"), ("r0-0", "r0"), ("r0-1", "r0"),
             ("r1-0", "r1")]  # fmt: skip
    for name, region in named:
        [placed] = _placed(rd, name)
        assert placed["region"] == region and placed["node_ip"] == cluster.ip
    # each coordinator listens on its node's address (perdure coordinator --host)
    for name in ("coordinator", "standby"):
        assert json.loads((rd / f"{name}.json").read_text())["host"] == cluster.ip
    [standby] = _placed(rd, "standby")
    assert _gone(standby["pid"], 10), "the standby outlived the run"
    assert "Traceback" not in (rd / "logs" / "standby.log").read_text()
    _assert_logs_merged(rd, STEPS)
    # placement by region: r0's processes on the head, r1's on a raylet of r1
    assert all(p["node_id"] == _placed(rd, "coordinator")[0]["node_id"] for p in
               _placed(rd, "r0-0") + _placed(rd, "r0-1"))  # fmt: skip
    assert _placed(rd, "r1-0")[0]["node_id"] != _placed(rd, "r0-0")[0]["node_id"]


def test_a_private_local_ray_ends_bitwise_equal_and_is_stopped_after(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """``ray.address = "local"``: a one-node Ray started for the run with every region's
    resource (the laptop path), stopped at its end. (Beside the module's cluster, whose
    fixture sets the authentication this new Ray uses too.)"""
    import ray

    summary = run(_config(small_dataset), run_dir=tmp_path / "run", timeout_s=TIMEOUT_S,
                  launcher="ray", ray_address="local")  # fmt: skip
    assert summary["final_hash"] == reference["final_hash"]
    assert not ray.is_initialized()
    [node] = {e["node_id"] for e in events(tmp_path / "run", ev.PROCESS_PLACED)}
    assert node


def test_a_killed_worker_process_and_a_killed_worker_actor_are_absorbed_bitwise_equal(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """A scheduled ``kill`` (SIGKILL to r0-1's process, sent through its actor) and a
    SIGKILL of r1-0's actor process, which takes its process with it: Ray restarts the
    actor, the launcher starts the replacement in it, and it joins through admission."""
    cfg = _config(small_dataset, chaos={"faults": [{"kind": "kill", "target": "r0-1",
                                                    "at_step": 100}]})  # fmt: skip
    rd = tmp_path / "run"
    killed: list[int] = []

    def kill_actor() -> None:
        [placed] = _placed(rd, "r1-0")
        killed.append(placed["actor_pid"])
        os.kill(placed["actor_pid"], signal.SIGKILL)

    watcher = _at_step(rd, 3, kill_actor)
    summary = _on_ray(cfg, rd, cluster)
    watcher.join(5)
    assert killed, "the actor was never killed"
    assert summary["final_hash"] == reference["final_hash"]
    assert summary["survivor_restarts"] == 0
    exits = {e["worker"]: e for e in events(rd, ev.PROCESS_EXIT)}
    assert exits["r0-1"]["code"] == -9 and exits["r0-1"]["injected"] is True
    assert exits["r1-0"]["code"] == -9 and "cause" in exits["r1-0"]
    started = {e["worker"] for e in events(rd, ev.REPLACEMENT_STARTED)}
    assert started == {"r0-1", "r1-0"}
    first, second = _placed(rd, "r1-0")
    assert second["actor_pid"] != first["actor_pid"]  # Ray restarted the actor
    assert second["incarnation"] != first["incarnation"]
    joins = [e["pid"] for e in events(rd, ev.JOIN) if e["worker"] == "r1-0"]
    assert joins == [first["pid"], second["pid"]]  # the replacement joined the same run
    again = _placed(rd, "r0-1")
    assert len(again) == 2 and again[0]["actor_pid"] == again[1]["actor_pid"]  # same actor
    assert again[1]["forked"] is True  # from its actor's fork server
    assert all(f["absorbed"] for f in summary["failures"]), summary["failures"]
    _assert_logs_merged(rd, STEPS)


def test_the_driver_killed_takes_every_process_of_the_run_with_it(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path
) -> None:
    """Placed by node labels this time (``ray.placement = "label"``): each process on a
    node whose label ``region`` is its region; then the driver is SIGKILLed."""
    cfg = small_config(small_dataset, workers=3, regions=2, steps=100000,
                       ray={"placement": "label"})  # fmt: skip
    cfg_file = write_toml(to_dict(cfg), tmp_path / "run.toml")
    rd = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-m", "perdure", "run", str(cfg_file), "--run-dir", str(rd),
         "--launcher", "ray", "--ray-address", cluster.address, "--no-live"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **cluster.env()},
    )  # fmt: skip
    try:
        metrics = rd / "metrics.jsonl"
        end = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < end and driver.poll() is None, "the run never stepped"
            time.sleep(0.2)
        placed = events(rd, ev.PROCESS_PLACED)
        pids = {p for e in placed for p in (e["pid"], e["actor_pid"])}
        assert len(placed) == 4 and len(pids) == 8  # coordinator and 3 workers, each in an actor
        for e in placed:
            assert cluster.node_hosting(e["actor_pid"]).labels["region"] == e["region"], e
    finally:
        driver.kill()
        driver.wait(10)
    left = [p for p in pids if not _gone(p, 30)]
    assert left == [], f"processes of the run outlived its driver: {left}"


def test_a_killed_node_is_absorbed_and_its_worker_replaced_on_another_node(
    cluster: LocalRayCluster, small_dataset: Path, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """The raylet hosting r1-0 and everything it started is SIGKILLed mid-run: the
    survivors go on at once, Ray declares the node dead and restarts r1-0's actor on the
    other r1 node, whose replacement joins; the bits are the local run's. (Last in the
    module: the cluster is one node short afterwards, and gets it back.)"""
    rd = tmp_path / "run"
    victims: list[str] = []

    def kill_node() -> None:
        [placed] = _placed(rd, "r1-0")
        node = cluster.node_hosting(placed["actor_pid"])
        victims.append(node.name)
        node.kill()

    # The survivors' reads are slowed from the kill on (timing only, no bit changes): the
    # run's ~295 steps after it took ~6 s at 17 ms a step, and a replacement on a new node
    # (Ray's node death, the actor's restart, its fork server's imports) took 4.3 s idle
    # and over 6 s in a loaded CI, which saw the run end before it joined. At 15 ms a read
    # of a slot, a step takes over 45 ms for the next 25 s: the run outlasts it 2-3 times.
    pace = {"kind": "slow_storage", "target": "r0", "at_step": 5, "delay_ms": 15,
            "duration_s": 25.0}  # fmt: skip
    watcher = _at_step(rd, 5, kill_node)
    try:
        summary = _on_ray(_config(small_dataset, chaos={"faults": [pace]}), rd, cluster)
    finally:
        watcher.join(5)
        if victims:  # heal the cluster for whoever runs after
            cluster.nodes = [n for n in cluster.nodes if n.name != victims[0]]
            cluster.start_node(f"{victims[0]}b", region="r1", cpus=4)
    assert victims and victims[0] in ("n1", "n2")
    assert summary["final_hash"] == reference["final_hash"]
    assert summary["survivor_restarts"] == 0
    first, second = _placed(rd, "r1-0")
    assert second["node_id"] != first["node_id"]  # placed by Ray on the other r1 node
    # the replacement joined the same run (on a loaded machine, a replacement still at
    # idle priority may miss heartbeats, be evicted and join again: the same process)
    joins = [e["pid"] for e in events(rd, ev.JOIN) if e["worker"] == "r1-0"]
    assert list(dict.fromkeys(joins)) == [first["pid"], second["pid"]]
    [exit_] = [e for e in events(rd, ev.PROCESS_EXIT) if e["worker"] == "r1-0"]
    assert exit_["code"] == -9 and exit_["injected"] is False
    assert [e["worker"] for e in events(rd, ev.REPLACEMENT_STARTED)] == ["r1-0"]
    assert all(f["absorbed"] for f in summary["failures"]), summary["failures"]
