"""perdure.sim's parts: reduction costs, failure draws, the event loop and the policies."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from perdure.config import ConfigError
from perdure.sim import failures, load_calibration, load_sim_config, scenario, sharding
from perdure.sim.config import DeploymentConfig, FailureProcess, SimRegion, WorkloadConfig
from perdure.sim.engine import Context, simulate
from perdure.sim.failures import Event
from perdure.sim.policies import POLICIES
from perdure.sim.policies import perdure as perdure_policy
from perdure.sim.policies import torchft as torchft_policy
from perdure.sim.policies import torchrun as torchrun_policy
from perdure.sim.run import run_policy, variants
from perdure.sim.steptime import (
    AnalyticStep,
    ComputeModel,
    HostStep,
    Links,
    Parts,
    bucketed_exposed,
    chain_s,
    exact_s,
    hier_s,
    interp,
    ring_s,
    step_parts,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = ROOT / "configs" / "sim" / "deployment-46.toml"
WAN = Links(intra_bps=50e9, intra_lat_s=1e-5, cross_bps=12.5e9, cross_lat_s=0.03)


# -- reduction costs ----------------------------------------------------------------------


def test_one_region_never_pays_cross_region_latency() -> None:
    assert ring_s(4e9, (8,), WAN) == pytest.approx(ring_s(4e9, (8,), WAN.slower(1.0)))
    assert chain_s(4e9, (8,), WAN, 1.0) == pytest.approx(chain_s(4e9, (8,), WAN.slower(1.0), 1.0))


def test_hierarchical_beats_flat_across_regions() -> None:
    members = (96, 96, 88, 88)
    assert hier_s(4e9, members, WAN) < ring_s(4e9, members, WAN)
    # one cross-region latency instead of about 2R of them
    spike = WAN.slower(0.2)
    assert hier_s(4e9, members, spike) - hier_s(4e9, members, WAN) == pytest.approx(0.2)
    assert ring_s(4e9, members, spike) - ring_s(4e9, members, WAN) > 1.0


def test_chain_crosses_each_boundary_twice() -> None:
    members = (4, 4, 4)
    extra = chain_s(1e6, members, WAN.slower(0.1), 1.0) - chain_s(1e6, members, WAN, 1.0)
    assert extra == pytest.approx(2 * 2 * 0.1)


def test_int64_payload_moves_twice_the_bytes() -> None:
    one = exact_s(1e9, (8,), WAN, hier=False, int_bytes=4, block=256)
    two = exact_s(1e9, (8,), WAN, hier=False, int_bytes=8, block=256)
    assert two / one == pytest.approx(2.0, rel=0.02)


def test_host_curve_interpolates_and_clamps() -> None:
    curve = ((1, 0.2), (2, 0.1), (4, 0.15))
    assert interp(curve, 3) == pytest.approx(0.125)
    assert interp(curve, 0) == 0.2 and interp(curve, 9) == 0.15


# -- failures -----------------------------------------------------------------------------


def test_a_seed_draws_the_same_history_and_rates_scale() -> None:
    cfg = load_sim_config(DEPLOYMENT)
    horizon = cfg.workload.days * 86400
    assert failures.draw(cfg, 3, horizon) == failures.draw(cfg, 3, horizon)
    assert failures.draw(cfg, 3, horizon) != failures.draw(cfg, 4, horizon)
    scaled = replace(cfg, reference_rate=replace(cfg.reference_rate, scale=10.0))
    deaths = [e for e in failures.draw(scaled, 0, horizon) if e.kind == "worker_death"]
    expected = failures.rate_per_hour(cfg.failures[0], scaled) * horizon / 3600
    assert len(deaths) == pytest.approx(expected, rel=0.5)


def test_scheduled_region_loss_strikes_its_region() -> None:
    cfg = load_sim_config(DEPLOYMENT)
    losses = [e for e in failures.draw(cfg, 0, 30 * 86400) if e.kind == "region_loss"]
    assert [(e.t, e.region) for e in losses] == [(300 * 3600.0, 0)]
    assert losses[0].count == 12 * 8


# -- the event loop and the policies --------------------------------------------------------


def _host_context(
    system: str, *, spares: int = 0, ckpt_every: float = float("inf"), state_copy: str = "stall"
) -> Context:
    cal = load_calibration(ROOT / "benchmarks" / "results")
    step = HostStep(step_s=0.1, workers=3, curve=((1, 1.0), (4, 1.0)), slots=12, cores=3)
    env = scenario.Environment(
        one_way_s=0.0, wire_bps=1e12, storage_gbps=1e3, state_bytes=1e6, step_s=0.1
    )
    costs: object = {
        "perdure": lambda: scenario.perdure_costs(
            # the runtime's default form: the streamed exact sum, no salvage
            scenario.PerduePolicyConfig(
                spares=spares,
                reduction="exact_flat",
                state_copy=state_copy,  # type: ignore[arg-type]
            ),
            cal,
            env,
        ),
        "torchrun": lambda: scenario.torchrun_costs(scenario.TorchrunPolicyConfig(), cal, env),
        "torchft": lambda: scenario.torchft_costs(scenario.TorchftPolicyConfig(), cal, env),
    }[system]()
    return Context(
        step=step,
        target=(3,),
        workers_per_node=1,
        coordinator=0,
        standby=None,
        spares=spares,
        ckpt_every_steps=ckpt_every,
        ckpt_blocking_s=0.0,
        ckpt_lag_steps=0.0,
        costs=costs,
    )


@pytest.mark.parametrize("system", ["perdure", "torchrun", "torchft"])
def test_no_failure_is_goodput_one(system: str) -> None:
    out = simulate(_host_context(system), POLICIES[system], [], until_steps=100)
    assert out.step_goodput == pytest.approx(1.0)
    assert out.elapsed_s == pytest.approx(10.0)


def _kill(after: int, delay: float = 0.05) -> Event:
    return Event(t=0.0, kind="worker_death", after_steps=after, delay_s=delay)


def test_perdure_streamed_redoes_the_in_flight_step_and_keeps_every_commit() -> None:
    ctx = _host_context("perdure")
    c: perdure_policy.Costs = ctx.costs
    out = simulate(ctx, POLICIES["perdure"], [_kill(10)], until_steps=100)
    # lost: the 0.05 s of the step in flight, the epoch formation, and the join's stall
    # (an epoch change and the copy, state_copy = "stall" by default)
    extra = 0.05 + 2 * c.reconfigure_s + c.copy_s
    assert out.elapsed_s == pytest.approx(10.0 + extra, rel=1e-6)
    assert out.restarts == 0
    assert out.probes[0].new_s == pytest.approx(c.reconfigure_s + 0.1)


def test_a_form_with_a_buffer_per_slot_salvages_the_survivors_slots() -> None:
    """The chain and the step form keep each finished slot; the streamed form does not."""
    streamed = _host_context("perdure")
    assert not streamed.costs.salvage
    cal = load_calibration(ROOT / "benchmarks" / "results")
    env = scenario.Environment(
        one_way_s=0.0, wire_bps=1e12, storage_gbps=1e3, state_bytes=1e6, step_s=0.1
    )
    for reduction, overlap in (("chain", "bucketed"), ("exact_flat", "last_slot")):
        p = scenario.PerduePolicyConfig(reduction=reduction, overlap=overlap)
        assert scenario.perdure_costs(p, cal, env).salvage, (reduction, overlap)
    salvaging = replace(streamed, costs=replace(streamed.costs, salvage=True))
    kill = [_kill(10)]
    lost_streamed = simulate(streamed, POLICIES["perdure"], kill, until_steps=100).elapsed_s
    lost_salvaged = simulate(salvaging, POLICIES["perdure"], kill, until_steps=100).elapsed_s
    assert lost_streamed - lost_salvaged == pytest.approx(0.05 * 2 / 3, rel=1e-6)


def test_a_warm_spare_avoids_the_join() -> None:
    ctx = _host_context("perdure", spares=1)
    c: perdure_policy.Costs = ctx.costs
    out = simulate(ctx, POLICIES["perdure"], [_kill(10)], until_steps=100)
    assert out.elapsed_s == pytest.approx(10.0 + 0.05 + c.reconfigure_s + c.copy_s)
    # itemised: half a step in flight redone (0.05 s), the epoch, the copy to the spare
    # (no latency on this host: detection is free); the replacement refills the pool
    assert out.counts == {"worker_death": 1}
    assert out.ledger["worker_death"] == pytest.approx(
        {"lost": 0.05, "reform": c.reconfigure_s, "copy": c.copy_s}
    )


def _slower_with_two(copy_s: float, overlapped: bool) -> Context:
    """3 members and a warm spare on a host whose step is 0.1 s with 3 members and
    0.15 s with 2; a state copy of ``copy_s``."""
    ctx = _host_context("perdure", spares=1)
    step = HostStep(step_s=0.1, workers=3, curve=((2, 1.5), (3, 1.0)), slots=12, cores=3)
    costs = replace(ctx.costs, copy_s=copy_s, overlapped=overlapped)
    return replace(ctx, step=step, costs=costs)


def test_an_overlapped_copy_costs_the_step_the_spare_sits_out_and_the_copy_beyond_it() -> None:
    """A kill half-way through step 11: the spare is planned into the epoch that drops
    the dead worker. Stalled, everyone waits for its 0.25 s copy. Overlapped (the
    runtime's rule, ``runtime/member/copy_overlap.py``), the two survivors compute the
    epoch's first step without it (0.15 s), whose reduction waits for the copy: 0.10 s
    more (``copy``), and that step is 0.05 s slower than with 3 members (``reduced``)."""
    kill = [_kill(10)]
    stall = simulate(_slower_with_two(0.25, False), POLICIES["perdure"], kill, until_steps=100)
    over = simulate(_slower_with_two(0.25, True), POLICIES["perdure"], kill, until_steps=100)
    r = _slower_with_two(0.25, True).costs.reconfigure_s
    assert stall.ledger["worker_death"] == pytest.approx({"lost": 0.05, "reform": r, "copy": 0.25})
    assert over.ledger["worker_death"] == pytest.approx(
        {"lost": 0.05, "reform": r, "copy": 0.10, "reduced": 0.05}
    )
    assert stall.elapsed_s == pytest.approx(10.0 + 0.05 + r + 0.25)
    assert over.elapsed_s == pytest.approx(10.0 + 0.05 + r + 0.15)


def test_overlapping_a_copy_shorter_than_a_steps_slowdown_costs_more_than_stalling() -> None:
    """The limit of the overlapped copy: the spare sits out a whole step however short its
    copy, so a 0.01 s copy costs the run one step at 2 members (0.15 s for 0.10 s of
    work: 0.05 s) where stalling costs 0.01 s."""
    stall = simulate(
        _slower_with_two(0.01, False), POLICIES["perdure"], [_kill(10)], until_steps=100
    )
    over = simulate(_slower_with_two(0.01, True), POLICIES["perdure"], [_kill(10)], until_steps=100)
    assert stall.ledger["worker_death"]["copy"] == pytest.approx(0.01)
    assert over.ledger["worker_death"]["reduced"] == pytest.approx(0.05)
    assert over.elapsed_s - stall.elapsed_s == pytest.approx(0.04)


@pytest.mark.parametrize("name", ["deployment-46", "llama3-405b", "seed-600b"])
def test_on_every_shipped_config_the_overlapped_copy_is_never_worse(name: str) -> None:
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{name}.toml")
    cal = load_calibration(ROOT / "benchmarks" / "results")

    def goodput(state_copy: str) -> float:
        pp = replace(cfg.policies.perdure, state_copy=state_copy)
        return run_policy(
            replace(cfg, policies=replace(cfg.policies, perdure=pp)), cal, "perdure", 2
        ).goodput

    stall, over = goodput("stall"), goodput("overlapped")
    assert over >= stall, (name, over, stall)


def test_torchrun_redoes_every_step_since_the_checkpoint() -> None:
    ctx = _host_context("torchrun", ckpt_every=10)
    c: torchrun_policy.Costs = ctx.costs
    out = simulate(ctx, POLICIES["torchrun"], [_kill(16, 0.0)], until_steps=100)
    assert out.restarts == 1
    assert out.elapsed_s == pytest.approx(10.0 + c.restart_s + 6 * 0.1)
    # itemised: 6 steps since the checkpoint at 10 redone, the processes and the load
    assert out.ledger["worker_death"] == pytest.approx(
        {"lost": 0.6, "startup": c.restart.startup_s, "load": c.restart.load_s}
    )
    assert out.probes[0].new_s == pytest.approx(c.restart_s + 7 * 0.1)


def test_torchft_survivors_go_on_at_a_reduced_batch() -> None:
    ctx = _host_context("torchft")
    c: torchft_policy.Costs = ctx.costs
    out = simulate(ctx, POLICIES["torchft"], [_kill(10, 0.0)], until_steps=100)
    assert out.elapsed_s == pytest.approx(10.0 + c.quorum_s + c.join_s)
    # once the quorum has formed and until the group is back, its share of every step's
    # batch is missing
    missing = (c.group_start_s - c.quorum_s) / 0.1 / 3
    assert out.samples == pytest.approx(100 - missing, rel=1e-3)
    # itemised: the new quorum, and a third of the batch missing while the group restarts
    # (the host's step time does not change with the members here), then the re-formation
    assert out.ledger["worker_death"] == pytest.approx(
        {"reform": c.quorum_s + c.join_s, "reduced": (c.group_start_s - c.quorum_s) / 3}
    )


def test_a_hang_shorter_than_the_horizon_evicts_nobody() -> None:
    ctx = _host_context("perdure")
    c: perdure_policy.Costs = ctx.costs
    short = Event(t=1.0, kind="hang", duration_s=c.horizon_s / 2)
    out = simulate(ctx, POLICIES["perdure"], [short], until_steps=100)
    assert out.elapsed_s == pytest.approx(10.0 + c.horizon_s / 2)


def test_phi_horizon_is_about_the_acceptable_pause() -> None:
    h = scenario.horizon_s(0.1, 4.0, 10.0)
    assert 4.0 < h < 5.0


def test_the_simulator_calls_the_runtimes_rules_and_imports_without_torch() -> None:
    """The boundary margin is the runtime's own function; the settle after a failed
    collective is ``cluster.reform_backoff_ms``; and ``perdure.sim`` imports with torch
    blocked (a subprocess: this one has torch loaded)."""
    from perdure.runtime.config import ClusterConfig
    from perdure.runtime.control import policy as runtime_policy

    assert scenario.boundary_margin is runtime_policy.boundary_margin
    sim_default = scenario.PerduePolicyConfig().reform_backoff_ms / 1000
    assert sim_default == ClusterConfig().reform_backoff_ms / 1000 == runtime_policy.FAIL_SETTLE_S
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import perdure.sim, perdure.sim.run, perdure.sim.sweep, perdure.sim.scenario\n"
        "import perdure.sim.output, perdure.sim.validate\n"
        "print('ok')"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_a_death_inside_a_lost_region_changes_nothing() -> None:
    ctx = replace(_host_context("perdure"), target=(2, 1), standby=1)
    loss = Event(t=1.0, kind="region_loss", region=1, count=1, duration_s=5.0, silent=False)
    death = Event(t=2.0, kind="worker_death", region=1)
    alone = simulate(ctx, POLICIES["perdure"], [loss], until_steps=100)
    both = simulate(ctx, POLICIES["perdure"], [loss, death], until_steps=100)
    assert both.elapsed_s == pytest.approx(alone.elapsed_s)


# -- overlap: buckets behind the backward ---------------------------------------------------

ONE_SITE = Links(intra_bps=10e9, intra_lat_s=1e-4, cross_bps=10e9, cross_lat_s=1e-4)
"""4 workers in one region: a ring of 4e9 bytes is 2*3/4*4e9/10e9 = 0.6 s of bandwidth
and 2*3*1e-4 = 6e-4 s of latency."""


def _hand_step(reduction: str, overlap: str = "streamed", **kw: float) -> AnalyticStep:
    # 6 * 1e9 * 1e6 FLOPs over 8 slots at 1e15 FLOP/s: 0.75 s a slot, 2 slots a worker
    compute = ComputeModel(params=1e9, tokens_per_step=1e6, slots=8, worker_flops=1e15, workers=4)
    return AnalyticStep(
        compute=compute,
        links=ONE_SITE,
        reduction=reduction,
        grad_bytes=4,
        int_bytes=4,
        block=256,
        chain_over_ring=1.0,
        overlap=overlap,
        **kw,  # type: ignore[arg-type]
    )


def test_a_bucketed_reduction_exposes_its_last_bucket_and_one_latency() -> None:
    whole = Parts(bw=1.0, lat=0.1)
    assert bucketed_exposed(whole, 2.0, 10) == pytest.approx(0.1 + 0.1)  # hidden but the last
    assert bucketed_exposed(whole, 0.5, 10) == pytest.approx(1.0 - 0.5 * 0.9 + 0.1)
    assert bucketed_exposed(whole, 5.0, 1) == pytest.approx(1.1)  # one bucket: nothing hides


def test_ddp_hides_its_buckets_behind_the_whole_backward() -> None:
    step = _hand_step("ddp")
    buckets = math.ceil(4e9 / (25 * 2**20))  # 153
    assert step.seconds((4,)) == pytest.approx(1.5 + 0.6 / buckets + 6e-4)


def test_streamed_exact_hides_behind_the_last_slots_backward_only() -> None:
    step = _hand_step("exact_flat", step_overhead=1.02, streamed_bytes=1.0)
    window = 2 / 3 * 0.75  # the last of the member's 2 slots
    buckets = math.ceil(1e9 / 2**20)  # 954
    exposed = 0.6 - window * (1 - 1 / buckets) + 6e-4
    assert step.seconds((4,)) == pytest.approx((1.5 + exposed) * 1.02)
    # one member gone: 3 slots for the busiest, the same last-slot window
    ring3 = 2 * 2 / 3 * 4e9 / 10e9
    exposed3 = ring3 - window * (1 - 1 / buckets) + 4 * 1e-4
    assert step.seconds((3,)) == pytest.approx((3 * 0.75 + exposed3) * 1.02)


def test_the_pre_streaming_model_runs_max_then_payload_after_the_last_slot() -> None:
    step = _hand_step("exact_flat", "last_slot", overhead=1.03)
    maxima = 2 * 3 / 4 * (1e9 / 256 * 4) / 10e9 + 6e-4
    exposed = 0.6 + 6e-4 + maxima - 2 / 3 * 0.75
    assert step.seconds((4,)) == pytest.approx(1.5 * 1.03 + exposed)


def test_the_runtimes_two_tier_exchange_is_not_bucketed() -> None:
    members = (2, 2)
    streamed = _hand_step("exact_hier", streamed_bytes=1.0)
    bucketed = _hand_step("exact_hier", "bucketed", streamed_bytes=1.0)
    # two regions of 2: reduce-scatter 2*1/2*4e9/10e9 = 0.4 s, exchange 4e9/10e9 = 0.4 s,
    # latency 2*1e-4 + 1e-4; the MAX of the maxima goes first, the same way
    payload = 0.8 + 3e-4
    maxima = 2 * (1e9 / 256 * 4) / 10e9 + 3e-4
    assert streamed.seconds(members) == pytest.approx(1.5 + payload + maxima)
    buckets = math.ceil(1e9 / 2**20)
    hidden = 0.8 - 0.5 * (1 - 1 / buckets) + 3e-4
    assert bucketed.seconds(members) == pytest.approx(1.5 + hidden)
    # in one region there are no tiers: the flat group's buckets stream
    flat = _hand_step("exact_flat", streamed_bytes=1.0)
    assert streamed.seconds((4,)) == pytest.approx(flat.seconds((4,)))


# -- sharded replicas ------------------------------------------------------------------------


def _sharded(**kw: object) -> tuple[WorkloadConfig, DeploymentConfig]:
    w = WorkloadConfig(
        params=8e9,
        tokens_per_step=1e6,
        slots=100,
        layers=8,
        hidden=1000,
        **kw,  # type: ignore[arg-type]
    )
    gpus = w.tp * w.pp * w.shard
    d = DeploymentConfig(
        regions=[SimRegion(name="a", nodes=10)], workers_per_node=1, gpus_per_worker=gpus
    )
    return w, d


def test_a_gpu_holds_its_share_of_states_and_its_stages_activations() -> None:
    w, d = _sharded(tp=2, pp=2, shard=2)
    m = sharding.memory(w, d, perdure=True, int_bytes=4)
    # 8e9 / (2 * 2 * 2) = 1e9 parameters a GPU: 2 + 4 + 12 bytes each, and perdure's
    # int32 accumulator
    assert (m.weights, m.gradients, m.optimizer, m.reduction) == (2e9, 4e9, 12e9, 4e9)
    # 10 micro-batches a replica, 2 in flight on a stage of 4 layers, 1e6 / 100 / 2 = 5000
    # tokens each, 34 bytes per token, layer and unit of hidden size, over tp = 2
    assert m.activations == pytest.approx(4 * 2 * 5000 * 1000 * 34 / 2)
    ddp = sharding.memory(replace(w, recompute=True), d, perdure=False, int_bytes=4)
    assert ddp.reduction == 0.0
    assert ddp.activations == pytest.approx(4 * 2 * 5000 * 1000 * 2 / 2)


def test_a_replica_that_does_not_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "sim" / "llama3-405b.toml").read_text()
    pure_dp = text.replace("tp = 8", "tp = 1").replace("pp = 16", "pp = 1")
    path = tmp_path / "dp.toml"
    path.write_text(pure_dp.replace("gpus_per_worker = 128", "gpus_per_worker = 1"))
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    msg = str(info.value)
    # 405e9 x (2 + 4 + 12 + 4) bytes = 8910 GB of states on one GPU
    assert "needs 8942.3 GB" in msg and "optimizer 4860.0" in msg
    assert "deployment.gpu_memory_gb = 80 GB" in msg
    path.write_text(text.replace("gpus_per_worker = 128", "gpus_per_worker = 64"))
    with pytest.raises(ConfigError, match=r"tp x pp x shard = 8 x 16 x 1 = 128"):
        load_sim_config(path)


def test_tensor_parallel_traffic_and_the_pipeline_bubble_lengthen_the_slot() -> None:
    w, d = _sharded(tp=2, pp=2)
    # 4 layers a stage x 4 all-reduces of 1e6/100 tokens x 1000 x 2 bytes over 2 GPUs
    # of NVLink (3600 Gbit/s): 2 * 1/2 * 2e7 / 450e9 each
    tp = 4 * 4 * 2e7 / 450e9
    assert sharding.slot_comm_s(w, d, 1.0) == pytest.approx(tp)
    compute = ComputeModel(
        params=8e9, tokens_per_step=1e6, slots=100, worker_flops=4e15, workers=10, bubble=1.0
    )
    # 6 * 8e9 * 1e6 / 100 / 4e15 = 0.12 s a slot; 10 slots + a bubble of (2 - 1) / 1
    assert compute.ddp_s() == pytest.approx(11 * 0.12)
    assert compute.perdure_s(9) == pytest.approx((12 + 1) * 0.12)  # ceil(100 / 9) = 12


def test_fsdp_gathers_hide_behind_the_slot_up_to_its_compute() -> None:
    w, d = _sharded(shard=4)
    # 3 passes x 3/4 x 8e9 x 2 bytes over 400 Gbit/s = 0.72 s; a slot of 0.5 s hides 0.5
    assert sharding.slot_comm_s(w, d, 0.5) == pytest.approx(3 * 0.75 * 16e9 / 50e9 - 0.5)
    assert sharding.slot_comm_s(w, d, 1.0) == 0.0


def test_the_seeds_model_does_not_fit_four_replicas_on_80_gb(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "sim" / "seed-600b.toml").read_text()
    path = tmp_path / "h100.toml"
    path.write_text(text.replace("gpu_memory_gb = 192.0", "gpu_memory_gb = 80.0"))
    with pytest.raises(ConfigError) as info:
        load_sim_config(path)
    # 600e9 / 88 = 6.82e9 parameters a GPU x 22 bytes, and the stage's activations
    assert "needs 154.8 GB" in str(info.value)
    assert "deployment.gpu_memory_gb = 80 GB" in str(info.value)


# -- the yardstick and the spares ----------------------------------------------------------


def test_the_restart_policy_on_llama_3_is_within_005_of_the_papers_90_percent() -> None:
    """Llama 3 405B (Dubey et al. 2024, 3.3.4): "higher than 90% effective training
    time" over 54 days with 419 unexpected interruptions; restarts from checkpoints."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / "llama3-405b.toml")
    cal = load_calibration(ROOT / "benchmarks" / "results")
    summary = run_policy(cfg, cal, "torchrun", 3)
    assert abs(summary.goodput - 0.90) <= 0.05
    assert summary.failures == pytest.approx(419, rel=0.15)


def _node_deaths(state_copy: str, spares: int) -> tuple[float, dict[str, float]]:
    """deployment-46 with node deaths only (1 a day, 10-minute replacements)."""
    cfg = load_sim_config(DEPLOYMENT)
    cfg = replace(
        cfg, failures=[FailureProcess(kind="node_death", per_day=1.0, replace_minutes=10.0)]
    )
    cal = load_calibration(ROOT / "benchmarks" / "results")
    pp = replace(cfg.policies.perdure, spares=spares, state_copy=state_copy)
    r = run_policy(replace(cfg, policies=replace(cfg.policies, perdure=pp)), cal, "perdure", 2)
    return r.goodput, r.per_failure["node_death"]


def test_stalled_fewer_spares_than_a_nodes_workers_pay_two_copies_a_node_death() -> None:
    """The spares sweep's dip with the stalled copy: a node death promotes the spares
    there are (a copy) and the rest of its workers join later (a second copy), while the
    busiest member's slot count, hence the step, stays that of the short membership."""
    cfg = load_sim_config(DEPLOYMENT)
    cal = load_calibration(ROOT / "benchmarks" / "results")
    copy = scenario.context(cfg, cal, "perdure").costs.copy_s
    none, four, eight = (_node_deaths("stall", n) for n in (0, 4, 8))
    assert none[1]["copy"] == pytest.approx(copy)  # the join's
    assert four[1]["copy"] == pytest.approx(2 * copy)  # the promotion's and the join's
    assert eight[1]["copy"] == pytest.approx(copy)  # the promotion's; the rest refill the pool
    assert four[0] < none[0] < eight[0]


def test_overlapped_spares_short_of_a_node_change_goodput_by_under_1e_6() -> None:
    """With the overlapped copy a promotion costs no stall beyond its epoch change (the
    copy is shorter than the step it overlaps), so the copies' dip is gone. What is left
    is under 1e-6: fewer spares than a node's 8 workers leave the busiest member's 3 slots
    as they are, and the promoted ones add two ring hops each to every step until the
    node is back (0.05 s a node death with 4)."""
    g = [_node_deaths("overlapped", n)[0] for n in (0, 1, 4, 8)]
    assert max(g[:3]) - min(g[:3]) < 1e-6, g
    assert g[3] - g[0] > 1e-3, g


@pytest.mark.parametrize(
    "name", ["deployment-46", "deployment-46-diloco", "llama3-405b", "seed-600b"]
)
def test_the_cost_table_accounts_for_every_second_a_run_loses(name: str) -> None:
    """Elapsed time minus the full-batch steps' fault-free time is the sum of the
    ledger's items and the checkpoints' blocking time: nothing lost goes uncharged, and
    nothing is charged twice (within 1e-4 of the run: the step in flight at the end)."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{name}.toml")
    cal = load_calibration(ROOT / "benchmarks" / "results")
    for label, policy, c in variants(cfg):
        for out in run_policy(c, cal, policy, 1, label).outcomes:
            lost = out.elapsed_s - out.samples * out.step_s
            charged = sum(sum(items.values()) for items in out.ledger.values())
            assert lost > 0
            assert charged + out.checkpoint_s == pytest.approx(lost, abs=1e-4 * out.elapsed_s)


def test_the_step_by_dimension_sums_to_the_step() -> None:
    """The hand config of the overlap tests with a pipeline and tensor parallel traffic:
    the parts are the slots' FLOPs, the bubble, the replica's traffic, the exposed
    reduction and perdure's measured factor, and they add up to the step."""
    compute = ComputeModel(
        params=1e9,
        tokens_per_step=1e6,
        slots=8,
        worker_flops=1e15,
        workers=4,
        bubble=0.5,
        slot_comm_s=0.01,
    )
    step = replace(_hand_step("exact_flat", step_overhead=1.02), compute=compute)
    parts = step_parts(step, (4,))
    assert parts["compute"] == pytest.approx(2 * 0.75)
    assert parts["bubble"] == pytest.approx(0.5 * 0.75)
    assert parts["replica"] == pytest.approx(2.5 * 0.01)
    assert parts["reduction"] == pytest.approx(step.exposed_s((4,)))
    assert sum(parts.values()) == pytest.approx(step.seconds((4,)))
    assert parts["runtime"] == pytest.approx(0.02 * (sum(parts.values()) - parts["runtime"]))


def test_a_spike_during_a_deaths_slower_steps_leaves_them_to_the_death() -> None:
    """The time below full strength belongs to the failure that took members away: a
    latency spike striking while a death's survivors run short does not take it over
    (its own slowdown then counts to the death); striking a run at full strength, the
    spike owns its slower steps."""
    curve = ((1, 3.0), (2, 1.5), (3, 1.0))  # 2 members: steps 1.5x as long
    ctx = replace(_host_context("perdure"), step=HostStep(0.1, 3, curve, 12, 3))
    death = Event(t=1.0, kind="worker_death", replace_s=30.0)
    spike = Event(t=5.0, kind="latency_spike", duration_s=1.0, extra_latency_s=0.02)
    both = simulate(ctx, POLICIES["perdure"], [death, spike], until_steps=1000)
    assert "latency_spike" not in both.ledger
    alone = simulate(ctx, POLICIES["perdure"], [death], until_steps=1000)
    # the spike's second: steps of 0.15 + 0.02 s where they would have been 0.15, each
    # second then short of 0.1 / 0.17 full steps instead of 0.1 / 0.15
    spike_s = 1.0 * (0.1 / 0.15 - 0.1 / 0.17)
    assert both.ledger["worker_death"]["reduced"] == pytest.approx(
        alone.ledger["worker_death"]["reduced"] + spike_s, rel=1e-9
    )
    first = replace(spike, t=0.2, duration_s=0.5)  # over before the death
    early = simulate(ctx, POLICIES["perdure"], [first, death], until_steps=1000)
    assert early.ledger["latency_spike"] == pytest.approx({"reduced": 0.5 * (1 - 0.1 / 0.12)})


def test_a_replacement_arriving_while_the_spare_copies_refills_the_pool_not_a_second_copy() -> None:
    """The spare's 5 s overlapped copy outlasts its replacement's start (hardware back at
    once, the launcher's 0.5 s, start-up, a boundary): the replacement finds nobody
    missing, so it refills the pool, and the run pays the one copy (less the step it
    overlaps), as the stalled copy pays one."""
    kill = [replace(_kill(10), replace_s=0.0)]
    over_ctx = _slower_with_two(5.0, True)
    over = simulate(over_ctx, POLICIES["perdure"], kill, until_steps=100)
    stall = simulate(_slower_with_two(5.0, False), POLICIES["perdure"], kill, until_steps=100)
    assert over_ctx.costs.replace_after_s + over_ctx.costs.start_s < 5.0
    assert over.ledger["worker_death"]["copy"] == pytest.approx(5.0 - 0.15)
    assert stall.ledger["worker_death"]["copy"] == pytest.approx(5.0)
    assert over.elapsed_s < stall.elapsed_s
