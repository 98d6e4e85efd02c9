from __future__ import annotations

from perdure.runtime.control.detector import PhiAccrual


def _steady(pause_s: float) -> tuple[PhiAccrual, float]:
    d = PhiAccrual(expected_interval_s=0.1, acceptable_pause_s=pause_s)
    t = 0.0
    for _ in range(100):
        t += 0.1
        d.heartbeat(t)
    return d, t


def test_phi_stays_low_while_heartbeats_arrive() -> None:
    d, t = _steady(1.0)
    assert d.phi(t + 0.1) < 1.0


def test_a_spike_shorter_than_the_acceptable_pause_is_not_suspected() -> None:
    d, t = _steady(4.0)
    assert d.phi(t + 3.0) < 1.0


def test_silence_past_the_horizon_crosses_the_threshold() -> None:
    d, t = _steady(1.0)
    horizon = d.horizon_s(10.0)
    assert 1.0 < horizon < 2.0
    assert d.phi(t + horizon - 0.05) < 10.0 <= d.phi(t + horizon + 0.05)
