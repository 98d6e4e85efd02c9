"""perdure.sim end to end: configs, calibration from the result files, validation, CLI."""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from perdure.cli import main
from perdure.config import ConfigError
from perdure.sim import load_calibration, load_sim_config, run_config
from perdure.sim.calibrate import REQUIRED, CalibrationError
from perdure.sim.config import PerduePolicyConfig
from perdure.sim.run import variants
from perdure.sim.scenario import copy_overlaps
from perdure.sim.validate import TOLERANCE, goodput_rows, validation

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SIM_CONFIGS = sorted((ROOT / "configs" / "sim").glob("*.toml"))
DEPLOYMENT = ROOT / "configs" / "sim" / "deployment-46.toml"
DEMO = ROOT / "configs" / "demo.toml"


def test_the_shipped_sim_configs_are_exactly_those_docs_simulation_md_describes() -> None:
    doc = (ROOT / "docs" / "simulation.md").read_text()
    named = set(re.findall(r"configs/sim/([\w.-]+\.toml)", doc))
    assert sorted(named) == [p.name for p in SIM_CONFIGS] == [
        "deployment-46-diloco.toml", "deployment-46.toml", "llama3-405b.toml", "seed-600b.toml"
    ]  # fmt: skip


@pytest.mark.parametrize("path", SIM_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_sim_config_loads(path: Path) -> None:
    cfg = load_sim_config(path)
    assert cfg.deployment.workers > 0
    assert cfg.failures


def test_deployment_46_is_the_reference_deployment() -> None:
    cfg = load_sim_config(DEPLOYMENT)
    assert len(cfg.deployment.regions) == 4
    assert cfg.deployment.nodes == 46
    assert cfg.workload.days == 30


def test_every_problem_of_a_sim_config_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        "seeds = 0\n[deployment]\nregions = [{ name = 'a', nodes = -1 }]\n"
        "coordinator_region = 'b'\n[[failures]]\nkind = 'meteor'\n"
        "[[failures]]\nkind = 'hang'\nregion = 'a'\n"
    )
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    keys = {p.key for p in info.value.problems}
    assert {
        "seeds",
        "deployment.regions[0].nodes",
        "deployment.coordinator_region",
        "failures[0].kind",
        "failures[1].duration_s",
    } <= keys
    assert str(path) in str(info.value)


def test_a_bad_state_copy_is_refused_naming_the_field_and_value(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        "[policies]\nperdure_state_copies = ['stall', 'swarm']\n"
        "[policies.perdure]\nstate_copy = 'broadcast'\ncopy_gbps = 0\n"
        "[sweeps]\ncopy_gbps = [1.0, -2.0]\n"
    )
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    problems = {p.key: str(p) for p in info.value.problems}
    assert {
        "policies.perdure.state_copy",
        "policies.perdure.copy_gbps",
        "policies.perdure_state_copies[1]",
        "sweeps.copy_gbps[1]",
    } <= set(problems)
    assert "'broadcast'" in problems["policies.perdure.state_copy"]
    assert "'swarm'" in problems["policies.perdure_state_copies[1]"]


def test_the_state_copy_rate_is_the_swarm_copys_measured_shares() -> None:
    """state_copy.json's shaped-link rows: holders on 100 Mbit/s links (a plain socket measured
    96.3 Mbit/s over one), the joiner on 300 (so 288.9 measured); one holder copied at 96
    Mbit/s, three at 265."""
    swarm = load_calibration(RESULTS).swarm
    assert swarm.per_holder == pytest.approx(96 / 96.3, rel=1e-12)  # 0.997
    assert swarm.cap == pytest.approx(265 / 288.9, rel=1e-12)  # 0.917
    assert swarm.fixed_s == 0.023
    gbit = 1e9 / 8  # bytes/s of a 1 Gbit/s link
    # 1 GB from one holder to a joiner on a 3x faster link: the holder's share of its own
    assert swarm.seconds(1e9, (gbit,), 3 * gbit) == pytest.approx(0.023 + 8 / (96 / 96.3))
    # the same links both ends: the joiner's cap (0.917) binds before the holder's 0.997
    assert swarm.seconds(1e9, (gbit,), gbit) == pytest.approx(0.023 + 8 / (265 / 288.9))
    # two holders: twice the rate, still under the joiner's cap (1.994 < 2.75)
    assert swarm.seconds(1e9, (gbit, gbit), 3 * gbit) == pytest.approx(0.023 + 8 / (2 * 96 / 96.3))
    # four holders into a 1 Gbit/s joiner: the joiner's cap, not the holders' sum
    assert swarm.seconds(1e9, (gbit,) * 4, gbit) == pytest.approx(0.023 + 8 / (265 / 288.9))
    with pytest.raises(ValueError, match="at least one holder"):
        swarm.seconds(1e9, (), gbit)


def test_the_sharded_save_and_load_rates_are_the_slowest_ranks() -> None:
    """reshard_load_100m.json: a rank's shard bytes over its seconds, the slowest rank
    (every rank works at once, the step waits for the last)."""
    data = json.loads((RESULTS / "reshard_load_100m.json").read_text())
    cal = load_calibration(RESULTS)

    def slowest(ranks: list[dict[str, float]], key: str) -> float:
        r = max(ranks, key=lambda r: r[key])
        return r["shard_bytes"] * 8 / r[key] / 1e9

    assert cal.sharded_save_gbps == slowest(data["save_perdure"]["ranks"], "seconds")
    assert cal.dcp_save_gbps == slowest(data["save_dcp"]["ranks"], "seconds")
    assert cal.dcp_load_gbps == slowest(data["dcp"]["ranks"], "dcp_load_seconds")


def test_a_copy_overlaps_only_where_the_runtimes_copy_rule_lets_it() -> None:
    """runtime/control/copy_rule.py: the exact reduction, exponents carried or streamed
    (the sim's ``bucketed`` and ``streamed``), shard degree 1, no DiLoCo."""
    exact = PerduePolicyConfig(reduction="exact_flat", state_copy="overlapped")
    assert copy_overlaps(exact)
    assert copy_overlaps(replace(exact, reduction="exact_hier", overlap="streamed"))
    assert copy_overlaps(replace(exact, state_copy="paced"))
    assert not copy_overlaps(replace(exact, state_copy="stall"))
    assert not copy_overlaps(replace(exact, reduction="chain"))
    assert not copy_overlaps(replace(exact, overlap="last_slot"))  # the step exponents
    assert not copy_overlaps(exact, shard=8)
    assert not copy_overlaps(exact, diloco=True)


def test_a_form_whose_copy_the_runtime_stalls_gets_no_overlapped_row() -> None:
    labels = [label for label, name, _ in variants(load_sim_config(DEPLOYMENT))]
    assert labels == [
        "perdure/chain/stall",
        "perdure/exact_flat/streamed/overlapped",
        "perdure/exact_flat/streamed/paced",
        "perdure/exact_flat/streamed/stall",
        "perdure/exact_flat/last_slot/stall",
        "perdure/exact_hier/streamed/overlapped",
        "perdure/exact_hier/streamed/paced",
        "perdure/exact_hier/streamed/stall",
        "perdure/exact_hier/bucketed/overlapped",
        "perdure/exact_hier/bucketed/paced",
        "perdure/exact_hier/bucketed/stall",
        "perdure/exact_hier/last_slot/stall",
        "torchrun",
        "torchft",
    ]


def test_llama3_rate_per_gpu_hour() -> None:
    ref = load_sim_config(DEPLOYMENT).reference_rate
    assert ref.per_gpu_hour == pytest.approx(419 / (16384 * 54 * 24))


def _copy_results(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out)
    return out


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_calibration_input_fails(tmp_path: Path, name: str) -> None:
    results = _copy_results(tmp_path)
    (results / f"{name}.json").unlink()
    with pytest.raises(CalibrationError, match=rf"{name}\.json"):
        load_calibration(results)


def test_a_missing_key_is_named(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    data = json.loads((results / "checkpoint.json").read_text())
    del data["snapshot"]["sync_copy"]["blocking_s"]
    (results / "checkpoint.json").write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"checkpoint\.json: missing snapshot\.sync_copy"):
        load_calibration(results)


def test_a_missing_demo_measurement_fails_the_validation(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    (results / "demo.json").unlink()
    with pytest.raises(CalibrationError, match=r"demo\.json.*bench_demo\.py"):
        validation(load_calibration(results), results, DEMO)


def _edit(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _slower_recoveries(data: dict) -> None:
    for run in data["recovery"]["perdure"]["runs"]:
        run["new_epoch_s"] += 2.0
        run["join_commit_gap_s"] += 2.0
    for run in data["recovery"]["torchrun"]["runs"]:
        run["recovery_s"] += 20.0


def test_a_measured_input_moves_the_prediction(tmp_path: Path) -> None:
    """No constant hides in the code: slower measured recoveries in a copy of
    recovery.json give lower predicted goodput, on the benchmark and at scale."""
    results = _copy_results(tmp_path)
    cfg = replace(load_sim_config(DEPLOYMENT), seeds=2, results_dir=str(RESULTS))
    before_cal = load_calibration(RESULTS)
    _edit(results / "recovery.json", _slower_recoveries)
    after_cal = load_calibration(results)
    assert after_cal.perdure_reconfigure_s == pytest.approx(before_cal.perdure_reconfigure_s + 2)

    bench_before = {r.system: r.predicted for r in goodput_rows(before_cal, RESULTS)}
    bench_after = {r.system: r.predicted for r in goodput_rows(after_cal, results)}
    assert bench_after["perdure"] < bench_before["perdure"] - 0.1
    assert bench_after["torchrun"] < bench_before["torchrun"] - 0.1

    scale_before = {s.policy: s.goodput for s in run_config(cfg, before_cal)}
    scale_after = {s.policy: s.goodput for s in run_config(cfg, after_cal)}
    assert scale_after["torchrun"] < scale_before["torchrun"]
    row = "perdure/exact_hier/streamed/overlapped"
    assert scale_after[row] < scale_before[row]


def test_benchmark_goodput_is_predicted_within_tolerance() -> None:
    """The shipped measurements: every goodput workload within 0.03 of its median."""
    cal = load_calibration(RESULTS)
    rows = [r for r in validation(cal, RESULTS, DEMO) if r.metric == "goodput"]
    assert {r.workload for r in rows} == {"goodput", "demo"}
    assert len(rows) == 5
    for r in rows:
        assert abs(r.diff) <= TOLERANCE, r


SHORT_SWEEPS = """
[sweeps]
rate_scale = [1.0, 10.0]
checkpoint_minutes = [30.0]
spares = [0, 8]
cross_region_latency_ms = [30.0]
seeds = 1
"""


def test_cli_prints_every_policy_and_writes_plots(tmp_path: Path) -> None:
    cfg, out = tmp_path / "d.toml", tmp_path / "out"
    # the config's own [sweeps] table (up to its first blank line) replaced by short ones
    text = re.sub(r"\n\[sweeps\][^\n]*\n(?:[^\n]+\n)*", "\n", DEPLOYMENT.read_text())
    cfg.write_text(text + SHORT_SWEEPS)
    res = CliRunner().invoke(main, ["sim", str(cfg), "--seeds", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("perdure/exact_hier", "perdure/chain", "torchrun", "torchft", "validation"):
        assert name in res.output
    assert "cost per failure" in res.output and "step by dimension" in res.output
    record = json.loads((out / "sim.json").read_text())
    assert {r["policy"] for r in record["goodput"]} >= {"torchrun", "torchft"}
    torchrun = next(r for r in record["goodput"] if r["policy"] == "torchrun")
    # a restart's items: what the failure waited for, the processes, the load, the redo
    per_death = torchrun["seconds_per_failure"]["worker_death"]
    assert {"wait", "startup", "load", "lost"} <= set(per_death)
    plots = sorted(p for p in out.iterdir() if p.suffix in (".png", ".svg"))
    assert len(plots) == 4
    for p in plots:
        if p.suffix == ".svg":
            assert ET.parse(p).getroot().tag.endswith("svg")


def test_cli_names_a_bad_results_dir(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"  # a top-level key: before the first table
    cfg.write_text(f'results_dir = "{tmp_path / "nowhere"}"\n' + DEPLOYMENT.read_text())
    res = CliRunner().invoke(main, ["sim", str(cfg), "--no-sweeps", "--no-validate"])
    assert res.exit_code != 0
    assert "calibration input missing" in res.output


def test_a_paced_copy_keeps_goodput_where_a_slow_copy_stalls_the_overlapped_one() -> None:
    """At 0.1 Gbit/s a GPU a 38 GB share copies for an hour: overlapped, every member waits
    for all of it but one step (goodput 0.73 on Llama 3's deployment); paced
    (``cluster.copy_step_mb``), no member waits and the joiner sits out the hour. At the
    links' own rate the copy hides behind one step either way: the same goodput."""
    cal = load_calibration(RESULTS)
    cfg = replace(load_sim_config(ROOT / "configs" / "sim" / "llama3-405b.toml"), seeds=2)
    p = cfg.policies

    def goodput(gbps: float | None) -> dict[str, float]:
        pp = replace(p.perdure, copy_gbps=gbps)
        rows = replace(
            p,
            run=["perdure"],
            perdure=pp,
            perdure_reductions=[],
            perdure_overlaps=[],
            perdure_state_copies=["overlapped", "paced"],
        )
        return {s.policy: s.goodput for s in run_config(replace(cfg, policies=rows), cal)}

    slow = goodput(0.1)
    assert slow["perdure/overlapped"] < 0.8
    assert slow["perdure/paced"] > 0.98
    fast = goodput(None)
    assert fast["perdure/paced"] == pytest.approx(fast["perdure/overlapped"], abs=1e-9)
