"""TensorBoard points are written once each, across a takeover and a relaunch; the
metrics config is checked; a taken Prometheus port is retried until it is free."""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest

from perdure.config.errors import ConfigError
from perdure.metrics.config import MetricsConfig
from perdure.metrics.service import MetricsService
from perdure.metrics.tensorboard import Point, TensorBoardSink, new_points
from perdure.metrics.view import snapshot


def _loss(steps: range, value: float = 1.0) -> list[Point]:
    return [Point("train/loss", s, value + s, float(s), 1000.0 + s) for s in steps]


def _read(log_dir: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_step_logged_twice_is_one_point() -> None:
    last: dict[str, float] = {}
    first = new_points(_loss(range(5)), last)
    again = new_points([*_loss(range(3, 5)), *_loss(range(5, 7))], last)
    assert [p.step for p in first] == [0, 1, 2, 3, 4]
    assert [p.step for p in again] == [5, 6]


def test_a_coordinator_taking_over_goes_on_after_its_predecessors_points(tmp_path: Path) -> None:
    primary = TensorBoardSink(tmp_path, takeover=False)
    primary.write(_loss(range(10)))
    primary.write([Point("membership/epoch", 0, 0, 0, 1.0), Point("failures/observed", 4, 1, 1, 2)])
    # the primary dies here (its writer is never closed); the standby has every log line
    standby = TensorBoardSink(tmp_path, takeover=True)
    assert standby.last == {
        "train/loss": 9.0,
        "membership/epoch": 0.0,
        "membership/members": 0.0,
        "failures/observed": 1.0,
    }
    assert standby.write(_loss(range(15))) == 5
    assert standby.write([Point("failures/observed", 4, 1, 1, 2)]) == 0
    standby.close()
    assert _read(tmp_path) == [(s, 1.0 + s) for s in range(15)]
    assert _read(tmp_path, "failures/observed") == [(4, 1.0)]


def test_a_relaunch_over_old_files_purges_the_steps_it_writes_again(tmp_path: Path) -> None:
    first = TensorBoardSink(tmp_path, takeover=False)
    first.write(_loss(range(20)))
    first.close()
    time.sleep(1.1)  # event file names carry the second they were made in
    resumed = TensorBoardSink(tmp_path, takeover=False)  # resumed from step 10, new config
    resumed.write(_loss(range(10, 15), value=100.0))
    resumed.close()
    got = _read(tmp_path)
    assert got == [(s, 1.0 + s) for s in range(10)] + [(s, 100.0 + s) for s in range(10, 15)]


def test_snapshot_reads_the_last_step_members_and_failures() -> None:
    metrics = [{"t": 1.0 + i, "step": i, "loss": 2.0 - i / 10, "step_s": 0.1} for i in range(4)]
    events = [
        {"t": 0.5, "event": "epoch_started", "epoch": 0, "start_step": 0,
         "plan": {"members": ["a", "b"]}},
        {"t": 2.5, "event": "epoch_started", "epoch": 1, "start_step": 2,
         "plan": {"members": ["a"]}},
        {"t": 3.5, "event": "checkpoint_saved", "step": 3},
        {"t": 2.2, "event": "fault_injected", "kind": "kill", "target": "b"},
    ]  # fmt: skip
    s = snapshot(metrics, events, [])
    assert (s.step, s.loss, s.members, s.membership_epoch) == (3, 1.7, 1, 1)
    assert s.membership_changes == 1 and s.checkpoint_step == 3
    assert s.faults == {("kill", "hardware"): 1}


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("port", 70000, "must be in [0, 65535]"),
        ("tensorboard_dir", "/abs", "must be a relative path inside the run directory"),
        ("tensorboard_dir", "a/../..", "must not leave the run directory"),
        ("poll_ms", 0, "must be in [10, 60000]"),
    ],
)
def test_metrics_config_names_the_field_the_rule_and_the_value(
    field: str, value: object, rule: str
) -> None:
    with pytest.raises(ConfigError) as e:
        MetricsConfig(**{field: value})  # type: ignore[arg-type]
    assert field in str(e.value) and rule in str(e.value) and repr(value) in str(e.value)


def test_a_taken_port_is_served_once_it_is_free(tmp_path: Path) -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    cfg = MetricsConfig(port=port, poll_ms=50, tensorboard=False)
    service = MetricsService(cfg, run_dir=tmp_path, host="127.0.0.1", steps=7)
    try:
        assert service.port is None
        holder.close()
        end = time.monotonic() + 10
        while service.port is None:
            assert time.monotonic() < end, "the endpoint never bound its port"
            time.sleep(0.05)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        run = f'{{run="{tmp_path.resolve()}"}}'.encode()
        assert b"perdure_steps_target" + run + b" 7.0" in body  # the run label tells runs apart
        assert b"\nperdure_step{" not in body  # no step committed: left out, not 0
    finally:
        service.close()
