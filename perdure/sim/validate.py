"""Predicted against measured: the workloads the benchmarks ran on this machine.

Each workload is simulated as it ran: 3 (or 8) worker processes time-sharing this
2-core host (:class:`~perdure.sim.steptime.HostStep`: the measured fault-free step time,
scaled by the measured step-time-vs-workers curve while members are missing or a process
is starting), the faults of its schedule at the steps they struck, and each system's
measured costs (:mod:`perdure.sim.calibrate`) with no network terms (loopback).

- ``goodput``: ``bench_recovery.py``'s goodput pairs (300 steps, a kill every 50 steps),
  for perdure with and without a warm spare, torchrun and torchft. Its costs come from the
  *other* workload of that benchmark (a larger model, batch 6, one kill), so this is the
  out-of-sample check. Measured: min / median / max over the pairs.
- ``recovery``: that other workload itself, kill -> first new step; its costs were
  derived from these very runs, so this row checks the decomposition, not a prediction.
- ``demo``: ``configs/demo.toml``'s schedule (every failure class, 8 workers, 4 regions),
  measured by ``benchmarks/bench_demo.py``: goodput and each fault's recovery.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.chaos.config import ChaosConfig
from perdure.chaos.faults.poison_part import POISON_PART
from perdure.config import build
from perdure.runtime.config import ClusterConfig
from perdure.sim import scenario
from perdure.sim.calibrate import Calibration, CalibrationError
from perdure.sim.config import PerduePolicyConfig, TorchftPolicyConfig, TorchrunPolicyConfig
from perdure.sim.engine import Context, simulate
from perdure.sim.failures import Event
from perdure.sim.policies import POLICIES
from perdure.sim.steptime import HostStep

MONITOR_TICK_S = 0.05
"""The local launcher's monitor loop pass (``launch/local.py``): a fault ``at_step``
fires on the first pass after its step committed, half a pass late on average. The
peers' scripts kill themselves right after their commit."""
HOST_CORES = 2
"""Fallback when a result file does not record its machine's cores."""
KINDS = {
    "kill": "worker_death",
    "hang": "hang",
    "delay": "latency_spike",
    "comm_error": "link_flap",
    "region_down": "region_loss",
    POISON_PART: "nan_part",
}
"""perdure's fault kinds (``chaos/faults/``) as the simulator's failure kinds. A
``region_down`` kills processes (sockets close: not silent)."""
TOLERANCE = 0.03
"""Goodput difference above which a row must be explained (docs/simulation.md)."""
NOT_COMPARABLE = {
    "delay": "the runtime's recover_s is the commit after the planner's re-plan (slots "
    "moved), which the simulator does not model; it gives the first commit under the spike",
}
"""Fault kinds whose measured recover_s is a different quantity from the simulator's."""


@dataclass(frozen=True)
class Row:
    """One predicted-against-measured comparison."""

    workload: str
    system: str
    metric: str
    predicted: float
    measured: float
    low: float
    high: float
    note: str = ""

    @property
    def diff(self) -> float:
        return self.predicted - self.measured

    @property
    def in_range(self) -> bool:
        """Inside the spread of the measured repeats."""
        return self.low <= self.predicted <= self.high

    @property
    def flagged(self) -> bool:
        """A goodput row off by more than the tolerance."""
        return self.metric == "goodput" and abs(self.diff) > TOLERANCE


def _cores(results: Path, name: str) -> int:
    try:
        machine = json.loads((results / f"{name}.json").read_text()).get("machine", {})
    except (OSError, json.JSONDecodeError):
        return HOST_CORES
    return int(machine.get("affinity_cores") or machine.get("cores") or HOST_CORES)


def _loopback(cal: Calibration, params: float, step_s: float) -> scenario.Environment:
    """This host, no network terms; a state copy as those runs made it (one source, the
    broadcast path's measured rate: they ran before the swarm copy)."""
    return scenario.Environment(
        one_way_s=0.0,
        wire_bps=float("inf"),
        storage_gbps=float("inf"),
        state_bytes=params * cal.state_bytes_per_param,
        step_s=step_s,
        copy_bps=scenario.gbps_to_bps(cal.broadcast_copy_gbps),
    )


def _context(
    system: str,
    step: HostStep,
    cal: Calibration,
    env: scenario.Environment,
    *,
    target: tuple[int, ...],
    spares: int = 0,
    ckpt_every: int | None = None,
    perdure: PerduePolicyConfig | None = None,
    coordinator: int = 0,
    standby: int | None = None,
) -> Context:
    costs: object
    if system == "perdure":
        costs = scenario.perdure_costs(
            perdure or PerduePolicyConfig(spares=spares, state_copy="stall"), cal, env
        )
    elif system == "torchrun":
        costs = scenario.torchrun_costs(TorchrunPolicyConfig(), cal, env)
    else:
        costs = scenario.torchft_costs(TorchftPolicyConfig(), cal, env)
    return Context(
        step=step,
        target=target,
        workers_per_node=1,
        coordinator=coordinator,
        standby=standby,
        spares=spares,
        ckpt_every_steps=float(ckpt_every) if ckpt_every else float("inf"),
        ckpt_blocking_s=0.0,  # inside the measured fault-free step
        ckpt_lag_steps=0.0,  # the peer's torch.save is synchronous
        costs=costs,
    )


def _kills(steps: tuple[int, ...], system: str) -> list[Event]:
    delay = MONITOR_TICK_S / 2 if system == "perdure" else 0.0
    return [Event(t=0.0, kind="worker_death", after_steps=s + 1, delay_s=delay) for s in steps]


def goodput_rows(cal: Calibration, results: Path) -> list[Row]:
    """``bench_recovery.py``'s goodput pairs, each system as it ran."""
    rows = []
    w, slots = 3, _goodput_batch(results)
    for run in cal.goodput_runs:
        system = run.name.split(",")[0]
        spares = 1 if "spare" in run.name else 0
        step = HostStep(
            step_s=run.step_s,
            workers=w,
            curve=cal.host_curve,
            slots=slots,
            cores=_cores(results, "recovery"),
        )
        env = _loopback(cal, cal.goodput_model_params, run.step_s)
        ctx = _context(
            system, step, cal, env, target=(w,), spares=spares, ckpt_every=run.ckpt_every
        )
        out = simulate(
            ctx, POLICIES[system], _kills(run.kill_steps, system), until_steps=run.steps - 1
        )
        lo, med, hi = run.goodput
        rows.append(Row("goodput", run.name, "goodput", out.step_goodput, med, lo, hi))
    return rows


def _goodput_batch(results: Path) -> int:
    data = json.loads((results / "recovery.json").read_text())
    try:
        return int(data["workload"]["goodput_global_batch"])  # slots = B in the benchmark
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(
            f"{results}/recovery.json: missing workload.goodput_global_batch"
        ) from None


def recovery_rows(cal: Calibration, results: Path) -> list[Row]:
    """Kill -> first new step in the recovery workload (3 replicas, batch 6, kill after
    step 15, torchrun checkpointing every 10)."""
    data = json.loads((results / "recovery.json").read_text())
    wl = data["workload"]
    rows = []
    measured = {
        "perdure": (cal.perdure_recovery_s, cal.perdure_step_s),
        "torchrun": (cal.torchrun_recovery_s, cal.torchrun_step_s),
        "torchft": (cal.torchft_recovery_s, cal.torchft_step_s),
    }
    for system, (rec_s, step_s) in measured.items():
        runs = data["recovery"][system]
        spread = runs["recovery_s"]
        ckpt = runs["runs"][0].get("ckpt_every")
        step = HostStep(
            step_s=step_s,
            workers=3,
            curve=cal.host_curve,
            slots=int(wl["global_batch"]),
            cores=_cores(results, "recovery"),
        )
        env = _loopback(cal, float(wl["params_approx"]), step_s)
        ctx = _context(system, step, cal, env, target=(3,), ckpt_every=ckpt)
        kill = int(wl["kill_at"])
        out = simulate(ctx, POLICIES[system], _kills((kill,), system), until_steps=kill + 8)
        pred = out.probes[0].new_s if out.probes and out.probes[0].new_s is not None else 0.0
        rows.append(
            Row("recovery", system, "recovery_s", pred, rec_s, spread["min"], spread["max"])
        )
    return rows


def _demo(results: Path) -> dict[str, Any]:
    path = results / "demo.json"
    try:
        return dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise CalibrationError(
            f"validation input missing: {path} (run benchmarks/bench_demo.py)"
        ) from None


def demo_events(chaos: ChaosConfig, cluster: ClusterConfig) -> list[Event]:
    """The demo's schedule as simulator events, each at the step it strikes."""
    names = [r.name for r in cluster.regions]
    out = []
    for f in chaos.faults:
        kind = KINDS.get(f.kind)
        if kind is None or f.at_step is None:
            continue
        region = (
            names.index(f.target.rsplit("-", 1)[0]) if f.target.rsplit("-", 1)[0] in names else 0
        )
        out.append(
            Event(
                t=0.0,
                kind=kind,
                region=region,
                count=cluster.regions[region].workers if kind == "region_loss" else 1,
                duration_s=f.duration_s or 0.0,
                extra_latency_s=f.delay_ms / 1000,
                silent=False,
                after_steps=f.at_step + 1,
                delay_s=MONITOR_TICK_S / 2,
            )
        )
    return out


def demo_rows(cal: Calibration, results: Path, config: Path) -> list[Row]:
    """The demo's schedule: goodput (clean span / faulty span) and each fault's
    recovery (injection -> the next commit after the reaction)."""
    measured = _demo(results)
    raw = tomllib.loads(config.read_text())
    cluster = build(ClusterConfig, raw.get("cluster", {}), "cluster")
    chaos = build(ChaosConfig, raw.get("chaos", {}), "chaos")
    train = raw.get("train", {})
    steps = int(measured["steps"])
    step_s = float(measured["clean"]["span_s"]) / (steps - 1)
    target = tuple(r.workers for r in cluster.regions)
    step = HostStep(
        step_s=step_s,
        workers=sum(target),
        curve=cal.host_curve,
        slots=int(train.get("slots", 16)),
        cores=_cores(results, "demo"),
    )
    pcfg = PerduePolicyConfig(
        heartbeat_ms=cluster.heartbeat_ms,
        phi_threshold=cluster.phi_threshold,
        acceptable_pause_ms=cluster.acceptable_pause_ms,
        takeover_settle_ms=cluster.takeover_settle_ms,
        replace_after_ms=cluster.replace_after_ms,
        spares=cluster.spares,
        state_copy="stall",  # the demo ran before the overlapped copy
    )
    params = cal.goodput_model_params  # the demo's model is the benchmarks' small model
    names = [r.name for r in cluster.regions]
    ctx = _context(
        "perdure",
        step,
        cal,
        _loopback(cal, params, step_s),
        target=target,
        spares=cluster.spares,
        perdure=pcfg,
        coordinator=names.index(cluster.coordinator_region) if cluster.coordinator_region else 0,
        standby=names.index(cluster.standby_region) if cluster.standby_region else None,
    )
    out = simulate(ctx, POLICIES["perdure"], demo_events(chaos, cluster), until_steps=steps - 1)
    g = float(measured["goodput"])
    rows = [Row("demo", "perdure", "goodput", out.step_goodput, g, g, g)]
    faults = measured["faulty"].get("faults", [])
    for probe, fault in zip(out.probes, faults, strict=False):
        m = fault.get("recover_s")
        if m is None or probe.commit_s is None:
            continue
        name, note = f"perdure: {fault['kind']}", NOT_COMPARABLE.get(fault["kind"], "")
        row = Row("demo", name, "recover_s", probe.commit_s, float(m), float(m), float(m), note)
        rows.append(row)
    return rows


def validation(cal: Calibration, results: str | Path, demo_config: str | Path) -> list[Row]:
    """Every row of the validation table."""
    r = Path(results)
    return [*goodput_rows(cal, r), *recovery_rows(cal, r), *demo_rows(cal, r, Path(demo_config))]
