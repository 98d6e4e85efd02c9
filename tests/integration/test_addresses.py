"""Where the coordinator listens and what peers dial: the flags, the config, the checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from perdure.config.errors import ConfigError
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control.address import (
    coordinator_endpoints,
    interface_address,
    interface_of,
)
from perdure.runtime.control.coordinator import Coordinator
from perdure.runtime.entry import WorkerSpec

ROOT = Path(__file__).resolve().parents[2]


def _cluster(**fields: object) -> RunConfig:
    return with_overrides(RunConfig(), cluster=fields)


def test_flags_override_the_cluster_config_and_advertise_defaults_to_the_bind_address() -> None:
    cfg = _cluster(host="10.231.0.1", channel_port=29400, port=29401)
    e = coordinator_endpoints(cfg.cluster)
    assert (e.bind, e.advertise, e.channel_port, e.store_port) == (
        "10.231.0.1",
        "10.231.0.1",
        29400,
        29401,
    )
    e = coordinator_endpoints(
        cfg.cluster, host="10.231.0.2", advertise="head.example", channel_port=0, store_port=0
    )
    assert (e.bind, e.advertise, e.channel_port, e.store_port) == (
        "10.231.0.2",
        "head.example",
        0,
        0,
    )


def test_a_wildcard_bind_needs_an_address_to_advertise() -> None:
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 listens on every interface"):
        coordinator_endpoints(_cluster().cluster, host="0.0.0.0")
    e = coordinator_endpoints(_cluster().cluster, host="0.0.0.0", advertise="10.231.0.1")
    assert (e.bind, e.advertise) == ("0.0.0.0", "10.231.0.1")


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"channel_port": 70000}, "cluster.channel_port: must be in [0, 65535] (got 70000)"),
        (
            {"port": 29400, "channel_port": 29400},
            "cluster.channel_port: must differ from cluster.port (29400) (got 29400)",
        ),
        ({"advertise": "0.0.0.0"}, "cluster.advertise: must be an address peers can dial"),
        ({"max_reform_failures": 0}, "cluster.max_reform_failures: must be a finite number > 0"),
        (
            {"reform_backoff_ms": 100, "reform_backoff_max_ms": 50},
            "cluster.reform_backoff_max_ms: must be >= cluster.reform_backoff_ms (100)",
        ),
    ],
)
def test_address_and_backoff_fields_are_validated_naming_field_rule_and_value(
    fields: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _cluster(**fields)
    assert problem in str(info.value)


def test_interfaces_are_found_by_name_and_by_address() -> None:
    assert interface_address("lo") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("10.231.255.254") is None
    with pytest.raises(ValueError, match=r"--interface 'no-such0': no such network interface"):
        interface_address("no-such0")


def test_a_worker_takes_host_or_interface_not_both() -> None:
    with pytest.raises(ValueError, match=r"give --host \(10.0.0.1\) or --interface \(lo\)"):
        WorkerSpec(name="w", region="r", coordinators=["h:1"], host="10.0.0.1", interface="lo")
    spec = WorkerSpec(name="w", region="r", coordinators=["h:1"], interface="lo")
    assert spec.argv()[-4:-2] == ["--interface", "lo"]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def test_the_coordinator_listens_on_the_fixed_ports_of_its_bind_address_only(
    tmp_path: Path,
) -> None:
    host = "127.0.0.3"
    channel, store = _free_port(host), _free_port(host)
    cfg = _cluster(host=host, channel_port=channel, port=store, advertise="127.0.0.3")
    c = Coordinator(cfg, run_dir=str(tmp_path), token="t")
    try:
        assert (c.channel_port, c.store_port, c.host) == (channel, store, host)
        assert c.server.getsockname()[0] == host
        assert c.store.listener.getsockname()[0] == host
    finally:
        c.stop()
        c._shutdown()


def test_a_coordinator_that_cannot_bind_says_which_address_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PERDURE_RUN_TOKEN": "t"}
    cfg = tmp_path / "run.toml"
    cfg.write_text('[cluster]\nhost = "127.0.0.1"\n')
    out = subprocess.run(
        [
            *(sys.executable, "-m", "perdure", "coordinator", "--config", str(cfg)),
            *("--run-dir", str(tmp_path / "run"), "--host", "10.231.254.254"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "cannot listen on 10.231.254.254:0" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("host", ["10.0.0.7", "fd00::2", "::1", "[fd00::3]", "node-a"])
def test_a_coordinators_address_round_trips_through_the_workers_flag(host: str) -> None:
    from perdure.runtime.control.address import host_port
    from perdure.runtime.entry import parse_address

    text = host_port(host, 29500)
    assert text.count("[") == (1 if ":" in host else 0)
    assert parse_address(text) == (host.strip("[]"), 29500)
