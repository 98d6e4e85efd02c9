"""The etcd lease backend against a real etcd on loopback (its own ports and data dir,
killed at teardown), and the standby's probe against real coordinators."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control.coordinator import Coordinator
from perdure.runtime.control.etcd import EtcdError, EtcdLease, run_id
from perdure.runtime.control.fence import current_generation
from perdure.runtime.control.lease import Granted, LeaseView, Lost, acquire_for_primary
from perdure.runtime.control.lease_agent import probe
from tests.fence_support import etcd_server, free_port

ME = {"instance": "a", "channel": "127.0.0.1:1"}
OTHER = {"instance": "b", "channel": "127.0.0.1:2"}


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary (Debian: etcd-server)")
    with etcd_server(tmp_path_factory.mktemp("etcd") / "data") as url:
        yield url


def _wait_expired(lease: EtcdLease, timeout_s: float = 15.0) -> LeaseView:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        view = lease.observe()
        if not view.live:
            return view
        time.sleep(0.2)
    raise AssertionError("the etcd lease did not expire")


def test_one_holder_at_a_time_and_a_takeover_only_after_etcd_expired_the_lease(
    etcd: str,
) -> None:
    token = f"token-{time.monotonic_ns()}"
    primary, standby = EtcdLease([etcd], "/t", token, 1.0), EtcdLease([etcd], "/t", token, 1.0)
    assert standby.observe() == LeaseView()
    got = primary.acquire(LeaseView(), 0, ME)
    assert isinstance(got, Granted) and got.generation == 1
    view = standby.observe()
    assert (view.generation, view.state, view.live, view.holder["instance"]) == (
        1,
        "held",
        True,
        "a",
    )
    # the standby may not take a live lease, whatever it expects
    assert isinstance(standby.acquire(view, 0, OTHER), Lost)
    for _ in range(3):  # renewals keep it (etcd grants at least its 2 s minimum)
        time.sleep(0.5)
        assert isinstance(primary.renew(1), Granted)
    expired = _wait_expired(standby)  # the primary stopped renewing
    assert expired.holder["channel"] == "127.0.0.1:1"  # kept for the standby's probe
    took = standby.acquire(expired, 0, OTHER)
    assert isinstance(took, Granted) and took.generation == 2
    lost = primary.renew(1)
    assert isinstance(lost, Lost) and lost.view.generation == 2
    standby.end(2)
    ended = primary.observe()
    assert (ended.generation, ended.state, ended.live) == (2, "ended", False)


def test_a_holder_whose_etcd_lease_expired_unnoticed_renews_it_if_nobody_took_over(
    etcd: str,
) -> None:
    lease = EtcdLease([etcd], "/t", f"token-{time.monotonic_ns()}", 1.0)
    assert isinstance(lease.acquire(LeaseView(), 0, ME), Granted)
    _wait_expired(lease)
    again = lease.renew(1)
    assert isinstance(again, Granted) and again.generation == 1
    assert lease.observe().live


def test_a_primary_starts_above_the_run_directorys_fence(etcd: str, tmp_path: Path) -> None:
    from perdure.runtime.control.fence import install_fence

    install_fence(tmp_path, 5, OTHER)
    lease = EtcdLease([etcd], "/t", f"token-{time.monotonic_ns()}", 1.0)
    got = acquire_for_primary(lease, tmp_path, ME)
    assert got.generation == 6 and current_generation(tmp_path) == 6


def test_an_unreachable_etcd_is_a_clear_error_naming_every_endpoint() -> None:
    port = free_port()
    lease = EtcdLease([f"http://127.0.0.1:{port}"], "/t", "x", 1.0)
    with pytest.raises(EtcdError, match=rf"no etcd endpoint answered /v3/kv/range: .*{port}"):
        lease.observe()
    assert len(run_id("x")) == 16 and run_id("x") != run_id("y")


def _serving(tmp_path: Path, *, standby: bool) -> Coordinator:
    config = with_overrides(
        RunConfig(), cluster={"regions": [{"name": "r0", "workers": 1}], "lease_ttl_ms": 1000}
    )
    c = Coordinator(config, run_dir=str(tmp_path), token="t", standby=standby)
    threading.Thread(target=c.serve, kwargs={"deadline_s": 20}, daemon=True).start()
    return c


def test_the_probe_tells_a_serving_primary_from_a_standby_a_hung_port_and_a_closed_one(
    tmp_path: Path,
) -> None:
    primary = _serving(tmp_path, standby=False)
    standby = _serving(tmp_path, standby=True)
    try:
        ok, detail = probe(f"127.0.0.1:{primary.channel_port}", 2.0)
        assert ok and detail.endswith("serves generation 1")
        ok, detail = probe(f"127.0.0.1:{standby.channel_port}", 2.0)
        assert not ok and "does not serve (generation 0)" in detail
        with socket.create_server(("127.0.0.1", 0)) as hung:  # accepts, never speaks
            ok, detail = probe(f"127.0.0.1:{hung.getsockname()[1]}", 0.3)
            assert not ok and "timed out" in detail
        ok, detail = probe(f"127.0.0.1:{free_port()}", 0.3)
        assert not ok and "Connection refused" in detail
        assert probe("", 0.3) == (False, "no channel to probe ('')")
    finally:
        primary.stop()
        standby.stop()
