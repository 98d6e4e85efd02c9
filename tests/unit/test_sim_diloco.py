"""The simulator's DiLoCo policy: its step, its bytes across regions, a region's loss."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from perdure.cli import main
from perdure.config import ConfigError
from perdure.sim import load_calibration, load_sim_config, scenario
from perdure.sim.config import DilocoPolicyConfig, SweepConfig
from perdure.sim.diloco import DilocoStep, home_replicas
from perdure.sim.engine import Context, simulate
from perdure.sim.failures import Event
from perdure.sim.policies import POLICIES
from perdure.sim.policies import diloco as diloco_policy
from perdure.sim.run import cross_bytes_per_token, sync_label, variants
from perdure.sim.steptime import AnalyticStep, ComputeModel, Links
from perdure.sim.sweep import run_sweeps

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DILOCO = ROOT / "configs" / "sim" / "deployment-46-diloco.toml"

# -- a hand deployment: 2 regions of 2 workers, a slow link between them -------------------

LINKS = Links(intra_bps=10e9, intra_lat_s=1e-4, cross_bps=1e9, cross_lat_s=0.05)
BUCKETS = math.ceil(1e9 / 2**20)  # the streamed reduction's 1 Mi-value buckets: 954
REPLICA_S = 1.5 + 0.4 / BUCKETS + 2e-4
"""One replica's inner step on a region of 2: B / R = 5e5 tokens in 4 slots of 0.75 s
(6 x 1e9 x 1e6 / 8 slots / 1e15 FLOP/s), 2 a worker; the exact reduction of 4e9 bytes
over the region's ring (2 x 1/2 x 4e9 / 10e9 = 0.4 s) hides behind the last slot's
backward (2/3 x 0.75 = 0.5 s) but for its last bucket, plus 2 intra hops of latency."""
OUTER_FP32_S = (4e9 + 1e9 * 4 / 256) * (1 / 1e9 + 0.5 / 10e9) + 2 * (0.05 + 1e-4)
"""The outer exchange, fp32: the block maxima (4 bytes a 256 values), then the int32
payload, each across the link (bytes / 1e9) and all-gathered in the region (1/2 x
bytes / 10e9), each one cross-region latency and one intra hop."""
OUTER_INT8_S = (1e9 + 1e9 / 256) * (1 / 1e9 + 0.5 / 10e9) + 2 * (0.05 + 1e-4)
"""int8: a byte a value, a one-byte exponent a block."""


def _hand_diloco(h: int, *, precision: str = "fp32", overlap: bool = False) -> DilocoStep:
    compute = ComputeModel(
        params=1e9, tokens_per_step=1e6 / 2, slots=4, worker_flops=1e15, workers=4
    )
    replica = AnalyticStep(
        compute=compute,
        links=LINKS,
        reduction="exact_hier",
        grad_bytes=4,
        int_bytes=4,
        block=256,
        chain_over_ring=1.0,
        overlap="bucketed",
    )
    return DilocoStep(
        replica=replica,
        links=LINKS,
        home=home_replicas(2, 2),
        inner_steps=h,
        precision=precision,  # type: ignore[arg-type]
        int_bytes=4,
        block=256,
        values=1e9,
        overlap=overlap,
        ideal=6 * 1e9 * 1e6 / 4 / 1e15,
    )


def _context(step: DilocoStep) -> Context:
    cal = load_calibration(RESULTS)
    env = scenario.Environment(
        one_way_s=0.05, wire_bps=1e9, storage_gbps=1e3, state_bytes=1e9, step_s=1.5
    )
    p = scenario.perdure_costs(
        scenario.PerduePolicyConfig(reduction="exact_hier"), cal, env, diloco=True
    )
    return Context(
        step=step,
        target=(2, 2),
        workers_per_node=1,
        coordinator=0,
        standby=None,
        spares=0,
        ckpt_every_steps=math.inf,
        ckpt_blocking_s=0.0,
        ckpt_lag_steps=0.0,
        costs=diloco_policy.Costs(perdure=p, replica_copy_s=p.far_copy_s),
    )


@pytest.mark.parametrize(
    ("h", "precision", "overlap", "step_s"),
    [
        (10, "fp32", False, REPLICA_S + OUTER_FP32_S / 10),
        (10, "int8", False, REPLICA_S + OUTER_INT8_S / 10),
        # overlapped: 10 inner steps (15 s) hide the 4.3 s exchange whole
        (10, "fp32", True, REPLICA_S),
        # 2 inner steps (3.0 s) do not: the rest is exposed once a round
        (2, "fp32", True, REPLICA_S + (OUTER_FP32_S - 2 * REPLICA_S) / 2),
    ],
)
def test_without_failures_the_step_is_the_inner_step_and_the_outer_steps_share(
    h: int, precision: str, overlap: bool, step_s: float
) -> None:
    step = _hand_diloco(h, precision=precision, overlap=overlap)
    assert step.replica_s(2) == pytest.approx(REPLICA_S, rel=1e-12)
    out = simulate(_context(step), POLICIES["diloco"], [], until_steps=100)
    assert out.elapsed_s == pytest.approx(100 * step_s, rel=1e-12)
    assert out.step_s == pytest.approx(step_s, rel=1e-12)
    assert out.ledger == {}


def _loss_at(steps: float) -> Event:
    return Event(
        t=0.0,
        kind="region_loss",
        after_steps=steps,
        region=1,
        count=2,
        duration_s=1e6,  # not back before the run ends
        silent=False,
    )


@pytest.mark.parametrize(("overlap", "at", "redo"), [(False, 13, 3), (True, 13, 3), (True, 12, 12)])
def test_a_lost_region_costs_a_copy_and_the_inner_steps_since_the_outer_step(
    overlap: bool, at: int, redo: int
) -> None:
    """Region 1 goes 3 (or 2) inner steps into a round of 10: its replica moves to region
    0, which fetches the replica's state (a copy) and recomputes those steps on its 2
    workers; with the overlapped outer step, a loss 2 steps in (3.0 s) comes while the
    previous round's exchange (4.3 s) is still on the wire, so that round's 10 steps
    are recomputed too. Then region 0 computes both replicas in turn, alone: no outer
    exchange, twice the inner step."""
    step = _hand_diloco(10, overlap=overlap)
    ctx = _context(step)
    c: diloco_policy.Costs = ctx.costs
    out = simulate(ctx, POLICIES["diloco"], [_loss_at(at)], until_steps=100)
    lost = redo * REPLICA_S
    items = {
        "detection": c.perdure.close_s,
        "reform": c.perdure.reconfigure_s,
        "copy": c.replica_copy_s,
        "lost": lost,
    }
    for item, seconds in items.items():
        assert out.ledger["region_loss"][item] == pytest.approx(seconds, rel=1e-9), item
    stall = sum(items.values())
    full = step.seconds((2, 2))
    assert out.elapsed_s == pytest.approx(at * full + stall + (100 - at) * 2 * REPLICA_S)
    # the items add up: below full strength is the rest of the time lost
    reduced = (100 - at) * (2 * REPLICA_S - full)
    assert out.ledger["region_loss"]["reduced"] == pytest.approx(reduced, rel=1e-9)
    assert set(out.ledger) == {"region_loss"}
    assert out.elapsed_s - out.samples * out.step_s == pytest.approx(stall + reduced)


def test_the_death_of_a_regions_last_worker_moves_its_replica_too() -> None:
    """One worker a region (a replica group a region, as seed-600b.toml): its death
    empties the region, so its replica moves and recomputes the round's 3 inner steps,
    as a region's loss does; the replacement's join copies it home."""
    step = _hand_diloco(10)
    ctx = replace(_context(step), target=(1, 1))
    c: diloco_policy.Costs = ctx.costs
    death = Event(t=0.0, kind="worker_death", after_steps=13, region=1, replace_s=60.0)
    out = simulate(ctx, POLICIES["diloco"], [death], until_steps=100)
    # a replica alone on one worker: its 4 slots of 0.75 s, no reduction
    assert step.replica_s(1) == pytest.approx(3.0, rel=1e-12)
    items = out.ledger["worker_death"]
    assert items["lost"] == pytest.approx(3 * 3.0, rel=1e-9)
    # the join's copy comes from the other region (its own has no member)
    assert items["copy"] == pytest.approx(c.replica_copy_s + c.perdure.far_copy_s, rel=1e-9)
    assert out.elapsed_s - out.samples * out.step_s == pytest.approx(sum(items.values()))


def test_a_lost_regions_replica_goes_to_the_most_members_per_replica() -> None:
    cfg = load_sim_config(DILOCO)
    step = scenario.context(cfg, load_calibration(RESULTS), "diloco").step
    assert isinstance(step, DilocoStep)
    assert step.placement((96, 96, 88, 88)) == (1, 1, 1, 1)
    assert step.placement((0, 96, 88, 88)) == (0, 2, 1, 1)
    assert step.placement((0, 0, 88, 80)) == (0, 0, 2, 2)
    # us_west computes both replicas in turn; the overlapped int8 exchange (H = 50)
    # hides behind the inner steps
    assert step.seconds((0, 96, 88, 88)) == pytest.approx(2 * step.replica_s(96), rel=1e-12)


# -- the reference deployment: bytes across regions, the comparison ------------------------


@pytest.mark.parametrize("h", [10, 50, 200])
def test_diloco_sends_1_over_h_of_the_sync_bytes_per_token_and_int8_a_quarter_of_that(
    h: int,
) -> None:
    """fp32 pseudo-gradients go through the synchronous step's exact reduction (int32 and
    a 4-byte block maximum a 256 values) once every H steps; int8 sends a byte a value
    and a one-byte exponent a block: (1 + 1/256) / (4 + 4/256) = 1/4 of it."""
    cfg = load_sim_config(DILOCO)
    cal = load_calibration(RESULTS)
    sync = cross_bytes_per_token(cfg, scenario.context(cfg, cal, "perdure"))
    # 4 regions each send their 1e9 values to the 3 others over 8e6 tokens
    assert sync == pytest.approx(4 * 3 * 1e9 * (4 + 4 / 256) / 8e6, rel=1e-12)
    for precision, ratio in (("fp32", 1 / h), ("int8", 1 / (4 * h))):
        d = replace(cfg.policies.diloco, inner_steps=h, precision=precision)  # type: ignore[arg-type]
        c = replace(cfg, policies=replace(cfg.policies, diloco=d))
        got = cross_bytes_per_token(c, scenario.context(c, cal, "diloco"))
        assert got / sync == pytest.approx(ratio, rel=1e-12), precision


def test_the_output_compares_sync_and_diloco(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["sim", str(DILOCO), "--seeds", "1", "--no-sweeps", "--no-validate", "--out", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "loss per token differs from the synchronous step's and is NOT simulated" in res.output
    cfg = load_sim_config(DILOCO)
    labels = [label for label, _, _ in variants(cfg)]
    assert sync_label(cfg) == "perdure"
    assert len([lab for lab in labels if lab.startswith("diloco/")]) == 12
    table = res.output.split("throughput and bytes across regions")[1].split("cost per")[0]
    for label in labels:
        assert f"\n{label} " in table
    record = json.loads((out / "sim.json").read_text())
    rows = {r["policy"]: r for r in record["goodput"]}
    sync, h50 = rows["perdure"], rows["diloco/H50/int8/overlap"]
    assert h50["cross_bytes_per_token"] == pytest.approx(sync["cross_bytes_per_token"] / 200)
    assert h50["tokens_per_s"] > sync["tokens_per_s"]
    # a lost region's items in the cost table: the replica's copy and its recompute
    assert {"copy", "lost", "reduced"} <= set(h50["seconds_per_failure"]["region_loss"])


# -- config ---------------------------------------------------------------------------------


def test_bad_diloco_settings_name_their_fields(tmp_path: Path) -> None:
    text = DILOCO.read_text().replace("slots = 704", "slots = 706")
    text = text.replace("inner_steps = 50 ", "inner_steps = 0 ")
    text = text.replace('precision = "int8"', 'precision = "int4"\nreplicas = 2')
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    keys = {p.key for p in info.value.problems}
    assert {"policies.diloco.inner_steps", "policies.diloco.precision"} <= keys
    path.write_text(DILOCO.read_text().replace("slots = 704", "slots = 706"))
    with pytest.raises(ConfigError, match=r"workload\.slots.*multiple of policies\.diloco"):
        load_sim_config(path)
    fewer = DILOCO.read_text().replace("[policies.diloco]", "[policies.diloco]\nreplicas = 2")
    path.write_text(fewer)
    with pytest.raises(ConfigError, match=r"policies\.diloco\.replicas.*at least"):
        load_sim_config(path)


def test_diloco_defaults_to_one_replica_a_region() -> None:
    assert DilocoPolicyConfig().replicas is None
    assert home_replicas(4, 4) == (1, 1, 1, 1)
    assert home_replicas(6, 4) == (2, 2, 1, 1)


def test_the_capacity_sweep_slows_only_the_outer_exchange_of_diloco() -> None:
    """Between 400 and 10 Gbit/s across regions, DiLoCo's inner steps do not change;
    its outer exchange's crossing of 1e9 x (4 + 4/256) bytes takes X / 1.25e9 s instead
    of X / 50e9, once every H = 50 steps (the all-gather inside a region is the same)."""
    cfg = load_sim_config(DILOCO)
    sweeps = SweepConfig(
        rate_scale=[],
        checkpoint_minutes=[],
        spares=[],
        cross_region_latency_ms=[],
        cross_region_gbps=[10.0, 400.0],
        seeds=1,
    )
    (sweep,) = run_sweeps(replace(cfg, sweeps=sweeps), load_calibration(RESULTS))
    assert sweep.name == "cross_region_gbps"
    assert set(sweep.rows) == {label for label, _, _ in variants(cfg)}
    slow, fast = sweep.rows["diloco/H50/fp32"]
    x = 1e9 * (4 + 4 / 256)
    assert slow.step_s - fast.step_s == pytest.approx(x * (1 / 1.25e9 - 1 / 50e9) / 50)
    sync_slow, sync_fast = sweep.rows["perdure"]
    assert sync_slow.step_s > 6 * sync_fast.step_s
