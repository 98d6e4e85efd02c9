"""Simulate a config under each policy over several seeds, and summarise."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from perdure.sim import failures, scenario
from perdure.sim.calibrate import Calibration
from perdure.sim.config import PerduePolicyConfig, SimConfig
from perdure.sim.diloco import DilocoStep
from perdure.sim.engine import Context, Outcome, simulate
from perdure.sim.policies import POLICIES
from perdure.sim.steptime import AnalyticStep, cross_region_bytes, step_parts

DAY = 86400.0


@dataclass(frozen=True)
class Summary:
    """One policy's results over seeds: means and the 5th-95th percentile range."""

    policy: str
    """The row's label: a policy, or ``perdure/<reduction>``."""
    goodput: float
    low: float
    high: float
    efficiency: float
    """Mean :attr:`~perdure.sim.engine.Outcome.efficiency`."""
    step_s: float
    restarts: float
    failures: float
    outcomes: tuple[Outcome, ...]
    step_parts: dict[str, float] = field(default_factory=dict)
    """The fault-free step by dimension (``steptime.step_parts``; empty on a host)."""
    tokens_per_s: float = 0.0
    """Mean tokens trained a second of the run (full-batch steps x tokens a step over
    the elapsed time; throughput, not quality: DiLoCo's loss per token differs)."""
    cross_bytes_per_token: float = 0.0
    """Bytes crossing a region boundary per token at full strength (every flow)."""

    @property
    def counts(self) -> dict[str, float]:
        """Failures of each kind per run (mean over seeds)."""
        out: dict[str, float] = {}
        for o in self.outcomes:
            for kind, n in o.counts.items():
                out[kind] = out.get(kind, 0.0) + n / len(self.outcomes)
        return out

    @property
    def per_failure(self) -> dict[str, dict[str, float]]:
        """Seconds by item for one failure of each kind (every seed's total over every
        seed's count); ``(none)``: below full strength with no failure to charge."""
        totals: dict[str, dict[str, float]] = {}
        for o in self.outcomes:
            for kind, items in o.ledger.items():
                row = totals.setdefault(kind, {})
                for item, v in items.items():
                    row[item] = row.get(item, 0.0) + v
        n = {k: c * len(self.outcomes) for k, c in self.counts.items()}
        seeds = max(len(self.outcomes), 1)
        return {k: {i: v / (n.get(k) or seeds) for i, v in r.items()} for k, r in totals.items()}

    @property
    def checkpoint_s(self) -> float:
        """Seconds the periodic checkpoints blocked the loop, per run."""
        return statistics.fmean(o.checkpoint_s for o in self.outcomes)


def horizon_s(cfg: SimConfig) -> float:
    return cfg.workload.days * DAY


def variants(cfg: SimConfig) -> list[tuple[str, str, SimConfig]]:
    """(label, policy, config) of every row: each policy of ``policies.run``, perdure
    once per reduction of ``policies.perdure_reductions`` when it lists any, an exact
    reduction once per overlap model of ``policies.perdure_overlaps`` when it lists any
    (``exact_flat`` without ``bucketed``: the same as ``streamed`` there), and each of
    those once per state copy of ``policies.perdure_state_copies`` when it lists any."""
    out: list[tuple[str, str, SimConfig]] = []
    p = cfg.policies
    for name in p.run:
        if name == "perdure" and (p.perdure_reductions or p.perdure_overlaps):
            for red in p.perdure_reductions or [p.perdure.reduction]:
                overlaps = p.perdure_overlaps if red != "chain" else []
                if red == "exact_flat":  # a flat group streams bucketed already
                    overlaps = [o for o in overlaps if o != "bucketed"]
                for ov in overlaps or [p.perdure.overlap]:
                    pp = replace(p.perdure, reduction=red, overlap=ov)
                    label = f"perdure/{red}" + (f"/{ov}" if overlaps else "")
                    out += _state_copies(cfg, label, pp)
        elif name == "perdure":
            out += _state_copies(cfg, "perdure", p.perdure)
        elif name == "diloco":
            out += _diloco_variants(cfg)
        else:
            out.append((name, name, cfg))
    return out


def _state_copies(
    cfg: SimConfig, label: str, pp: PerduePolicyConfig
) -> list[tuple[str, str, SimConfig]]:
    """perdure with ``pp``, once per state copy listed (labels ending ``/<copy>``); no
    ``/overlapped`` or ``/paced`` row where the runtime's copy rule makes the copy stall
    (:func:`scenario.copy_overlaps`) and a ``/stall`` row is listed: it would repeat it."""
    p = cfg.policies
    out = []
    for sc in p.perdure_state_copies or [pp.state_copy]:
        one = replace(pp, state_copy=sc)
        refused = not scenario.copy_overlaps(one, cfg.workload.shard)
        if sc != "stall" and refused and "stall" in p.perdure_state_copies:
            continue
        tail = f"/{sc}" if p.perdure_state_copies else ""
        out.append((label + tail, "perdure", replace(cfg, policies=replace(p, perdure=one))))
    return out


def sync_label(cfg: SimConfig) -> str:
    """The row of perdure's configured synchronous step (the comparison's reference)."""
    rows = [(label, c) for label, name, c in variants(cfg) if name == "perdure"]
    same = [label for label, c in rows if c.policies.perdure == cfg.policies.perdure]
    return (same or [label for label, _ in rows] or ["perdure"])[0]


def _diloco_variants(cfg: SimConfig) -> list[tuple[str, str, SimConfig]]:
    """DiLoCo once per H, precision and overlap listed (``diloco/H<H>/<precision>``,
    ``/overlap`` when the outer update is applied one outer step late)."""
    p = cfg.policies
    out = []
    for h in p.diloco_inner_steps or [p.diloco.inner_steps]:
        for prec in p.diloco_precisions or [p.diloco.precision]:
            for ov in p.diloco_overlaps or [p.diloco.overlap]:
                d = replace(p.diloco, inner_steps=h, precision=prec, overlap=ov)
                label = f"diloco/H{h}/{prec}" + ("/overlap" if ov else "")
                out.append((label, "diloco", replace(cfg, policies=replace(p, diloco=d))))
    return out


def _parts(ctx: Context) -> dict[str, float]:
    if isinstance(ctx.step, AnalyticStep):
        return step_parts(ctx.step, ctx.target)
    if isinstance(ctx.step, DilocoStep):
        return ctx.step.parts(ctx.target)
    return {}


def cross_bytes_per_token(cfg: SimConfig, ctx: Context) -> float:
    """Bytes crossing a region boundary per token of the fault-free step."""
    p, tokens = cfg.workload.params, cfg.workload.tokens_per_step
    if isinstance(ctx.step, DilocoStep):
        return ctx.step.cross_region_bytes(ctx.target, p) / tokens
    if isinstance(ctx.step, AnalyticStep):
        return cross_region_bytes(ctx.step, ctx.target, p) / tokens
    return 0.0


def run_policy(
    cfg: SimConfig, cal: Calibration, name: str, seeds: int, label: str | None = None
) -> Summary:
    """``seeds`` runs of ``name``; seed i draws the same failures for every policy."""
    ctx = scenario.context(cfg, cal, name)
    outs = []
    n_failures = []
    for seed in range(seeds):
        history = failures.draw(cfg, seed, horizon_s(cfg))
        n_failures.append(len(history))
        if cfg.workload.steps is not None:
            outs.append(simulate(ctx, POLICIES[name], history, until_steps=cfg.workload.steps))
        else:
            outs.append(simulate(ctx, POLICIES[name], history, until_s=horizon_s(cfg)))
    g = [o.goodput for o in outs]
    low, high = spread(g)
    return Summary(
        policy=label or name,
        goodput=statistics.fmean(g),
        low=low,
        high=high,
        efficiency=statistics.fmean(o.efficiency for o in outs),
        step_s=outs[0].step_s,
        restarts=statistics.fmean(o.restarts for o in outs),
        failures=statistics.fmean(n_failures),
        outcomes=tuple(outs),
        step_parts=_parts(ctx),
        tokens_per_s=statistics.fmean(
            o.samples * cfg.workload.tokens_per_step / o.elapsed_s for o in outs
        ),
        cross_bytes_per_token=cross_bytes_per_token(cfg, ctx),
    )


def spread(values: list[float]) -> tuple[float, float]:
    """5th and 95th percentiles (the range for one seed: the value itself)."""
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=20, method="inclusive")
    return q[0], q[-1]


def run_config(cfg: SimConfig, cal: Calibration, seeds: int | None = None) -> list[Summary]:
    return [run_policy(c, cal, name, seeds or cfg.seeds, label) for label, name, c in variants(cfg)]
