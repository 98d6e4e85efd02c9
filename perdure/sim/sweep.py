"""Sweeps: one parameter at a time around the config, every policy at each point."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from perdure.sim.calibrate import Calibration
from perdure.sim.config import SimConfig
from perdure.sim.run import Summary, run_policy, variants


@dataclass(frozen=True)
class Sweep:
    """One sweep: its parameter, the values, and each policy's summaries along them."""

    name: str
    label: str
    values: tuple[float, ...]
    log_x: bool
    metric: str
    """What its plot shows: ``goodput`` (against each policy's own fault-free run) or
    ``efficiency`` (against compute alone: what moves when every step gets slower)."""
    rows: dict[str, tuple[Summary, ...]]


def _rate(cfg: SimConfig, v: float) -> SimConfig:
    return replace(cfg, reference_rate=replace(cfg.reference_rate, scale=v))


def _ckpt(cfg: SimConfig, v: float) -> SimConfig:
    return replace(cfg, checkpoint=replace(cfg.checkpoint, every_minutes=v))


def _spares(cfg: SimConfig, v: float) -> SimConfig:
    p = cfg.policies
    return replace(cfg, policies=replace(p, perdure=replace(p.perdure, spares=int(v))))


def _latency(cfg: SimConfig, v: float) -> SimConfig:
    return replace(cfg, deployment=replace(cfg.deployment, cross_region_latency_ms=v))


def _cross_gbps(cfg: SimConfig, v: float) -> SimConfig:
    return replace(cfg, deployment=replace(cfg.deployment, cross_region_gbps=v))


def _copy_gbps(cfg: SimConfig, v: float) -> SimConfig:
    p = cfg.policies
    return replace(cfg, policies=replace(p, perdure=replace(p.perdure, copy_gbps=v)))


Apply = Callable[[SimConfig, float], SimConfig]
SWEEPS: dict[str, tuple[str, Apply, bool, str, tuple[str, ...], bool]] = {
    "rate_scale": ("failure rate x", _rate, True, "goodput", (), False),
    "checkpoint_minutes": ("checkpoint interval, min", _ckpt, True, "goodput", (), False),
    "spares": ("perdure warm spares", _spares, False, "goodput", ("perdure",), False),
    "copy_gbps": (
        "perdure state-copy link, Gbit/s a GPU",
        _copy_gbps,
        True,
        "goodput",
        ("perdure",),
        False,
    ),
    "cross_region_latency_ms": (
        "cross-region latency, ms one way",
        _latency,
        True,
        "efficiency",
        (),
        True,
    ),
    "cross_region_gbps": (
        "cross-region capacity, Gbit/s",
        _cross_gbps,
        True,
        "efficiency",
        (),
        True,
    ),
}
"""name -> (axis label, how a value changes the config, log x axis, plotted metric, only
these policies, every perdure reduction of ``perdure_reductions`` or only the configured
one: the reductions differ in step time, which only the latency sweep moves)."""


def run_sweeps(cfg: SimConfig, cal: Calibration) -> list[Sweep]:
    out = []
    for name, (label, apply, log_x, metric, only, reductions) in SWEEPS.items():
        values = tuple(float(v) for v in getattr(cfg.sweeps, name))
        if not values:
            continue
        base = cfg if reductions else _one_reduction(cfg)
        rows = {
            label: tuple(
                run_policy(apply(c, v), cal, name, cfg.sweeps.seeds, label) for v in values
            )
            for label, name, c in variants(base)
            if not only or name in only
        }
        out.append(Sweep(name, label, values, log_x and min(values) > 0, metric, rows))
    return out


def _one_reduction(cfg: SimConfig) -> SimConfig:
    """perdure with its configured reduction only (labelled with it), DiLoCo with its
    configured H, precision and overlap only."""
    p = cfg.policies
    return replace(
        cfg,
        policies=replace(
            p,
            perdure_reductions=[p.perdure.reduction],
            perdure_overlaps=[],
            perdure_state_copies=[],
            diloco_inner_steps=[],
            diloco_precisions=[],
            diloco_overlaps=[],
        ),
    )
