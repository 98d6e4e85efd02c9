"""The pure parts of benchmarks/bench_wire.py: rows from the command line, the wire
floor, step statistics, the byte-counter interpolation (no namespaces needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_wire as bw
from _wire_link import at, tbf_args

from perdure.run_config import config_from_dict


def test_a_row_is_a_name_and_config_overrides_by_section() -> None:
    row = bw.parse_row("c32:reduction=exact,reduction_bits=32,cluster.slow_ratio=2.5,x.y=true")
    assert row.name == "c32"
    assert row.overrides == {
        "train": {"reduction": "exact", "reduction_bits": 32},
        "cluster": {"slow_ratio": 2.5},
        "x": {"y": True},
    }


@pytest.mark.parametrize("spec", ["noname", ":reduction=exact", "a:reduction", "a:=3", "a b:x=1"])
def test_a_malformed_row_is_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(ValueError, match="--perdure"):
        bw.parse_row(spec)


def test_a_row_is_one_more_flag_not_code() -> None:
    a = bw.parse_args(["--perdure", "c32:reduction=exact,reduction_bits=32"])
    assert [r.name for r in a.rows] == ["c32"]
    assert [r.name for r in bw.parse_args([]).rows] == [
        "streamed32",
        "chain",
        "exact64",
        "exact32",
        "carried",
    ]
    assert bw.main(["--perdure", "broken"]) == 2


def test_every_default_row_is_a_config_the_runtime_accepts() -> None:
    for spec in bw.DEFAULT_ROWS:
        for slots, k in ((2, 1), (8, 2)):
            cfg = bw.perdure_config(bw.MODELS["5M"], bw.parse_row(spec), slots=slots,
                                    shard_degree=k, steps=10, dataset="/d", host="10.231.1.3",
                                    ports=29600)  # fmt: skip
            c = config_from_dict(cfg)
            assert (c.train.slots, c.train.shard_degree, c.train.shard_params) == (slots, k, k > 1)


def test_the_wire_floor_is_the_fp32_ring_bytes_over_the_rate() -> None:
    # the baseline: 4.94M parameters, W = 2, 380 Mbit/s -> 0.416 s
    assert bw.ring_bytes(4_940_000, 2) == 4 * 4_940_000
    assert bw.wire_floor_s(4_940_000, 2, 380.0) == pytest.approx(0.416, abs=1e-3)
    assert bw.ring_bytes(100, 4) == pytest.approx(2 * 3 / 4 * 400)
    assert bw.wire_floor_s(100, 2, 0) is None


def test_step_statistics_are_median_and_inclusive_deciles() -> None:
    s = bw.step_stats([float(x) for x in range(1, 12)])
    assert s == {"median": 6.0, "p10": 2.0, "p90": 10.0, "n": 11}
    assert bw.step_stats([]) is None
    assert bw.step_stats([0.5]) == {"median": 0.5, "p10": 0.5, "p90": 0.5, "n": 1}


def test_counters_are_interpolated_between_samples_and_clamped_outside() -> None:
    samples = [(10.0, 0, 100), (11.0, 1000, 300)]
    assert at(samples, 10.5, 1) == 500
    assert at(samples, 10.25, 2) == 150
    assert at(samples, 9.0, 1) == 0 and at(samples, 12.0, 1) == 1000


def test_ratios_are_to_ddp_at_the_same_micro_batching() -> None:
    rows = [
        {"method": "ddp", "micro": 1, "step_s": bw.step_stats([0.5]), "wire_mb_per_step": 20.0},
        {"method": "ddp", "micro": 4, "step_s": bw.step_stats([0.6]), "wire_mb_per_step": 20.0},
        {"method": "perdure", "micro": 4, "step_s": bw.step_stats([0.9]), "wire_mb_per_step": 40.0},
        {"method": "perdure", "micro": 1, "error": "run failed", "label": "perdure x"},
    ]
    for r in rows:
        r.setdefault("label", r["method"])
    bw.derive(rows, 0.4)
    assert rows[2]["vs_ddp"] == pytest.approx(1.5) and rows[2]["bytes_vs_ddp"] == 2.0
    assert rows[3]["wire_floor_s"] == 0.4 and "vs_ddp" not in rows[3]
    assert "run failed" in bw.table(rows)


def test_the_shaper_is_tbf_at_the_root_with_the_given_rate() -> None:
    args = tbf_args(200, 256, 50)
    assert args == ["root", "tbf", "rate", "200mbit", "burst", "256kb", "latency", "50ms"]
