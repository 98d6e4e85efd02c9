"""Failure histories: each failure process of a config drawn into a list of events.

A rate is a Poisson process over the whole deployment (exponential gaps from a seeded
``random.Random``); its target is drawn uniformly from the kind's scope, a region with
probability proportional to its nodes. Every process draws from its own generator
(seeded from the run seed and the process's index), so adding a process or a policy
does not move the others' failures, and every policy of a seed faces the same history.

Derivation of rates from the reference study (:class:`~perdure.sim.config.ReferenceRate`):
rate per hour = share x interruptions / (GPUs x days x 24) x the deployment's GPUs
(workers x GPUs per worker), times the sweep's scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from perdure.sim.config import FailureProcess, SimConfig

HOUR = 3600.0


@dataclass(frozen=True)
class Event:
    """Something that happens to the run: a failure, or a consequence of one."""

    t: float
    """When (s); ignored while ``after_steps`` is set."""
    kind: str
    """A failure kind, or a follow-up a policy scheduled (``spike_end``, ``region_back``,
    ``hardware_back``, ``launch``, ``started``, ``replaced``, ``resumed``, ``group_back``)."""
    region: int = 0
    count: int = 1
    """Workers concerned (a node's workers, a region's)."""
    duration_s: float = 0.0
    extra_latency_s: float = 0.0
    replace_s: float = 0.0
    silent: bool = True
    after_steps: float | None = None
    """Fire once this many steps have committed (then ``delay_s`` later) instead of at t."""
    delay_s: float = 0.0
    cause: str = ""
    """The failure kind a follow-up comes from (set by the loop): the ledger's row."""


def rate_per_hour(p: FailureProcess, cfg: SimConfig) -> float:
    """The process's rate over the deployment, per hour (see the module docstring)."""
    gpus = cfg.deployment.workers * cfg.deployment.gpus_per_worker
    ref = cfg.reference_rate
    return (p.share * ref.per_gpu_hour * gpus + p.per_day / 24.0) * ref.scale


def _region(rng: random.Random, cfg: SimConfig) -> int:
    weights = [r.nodes for r in cfg.deployment.regions]
    return rng.choices(range(len(weights)), weights=weights)[0]


def _count(kind: str, cfg: SimConfig, region: int) -> int:
    if kind == "node_death":
        return cfg.deployment.workers_per_node
    if kind == "region_loss":
        return cfg.deployment.regions[region].nodes * cfg.deployment.workers_per_node
    return 1


def _event(p: FailureProcess, t: float, rng: random.Random, cfg: SimConfig) -> Event:
    names = [r.name for r in cfg.deployment.regions]
    region = names.index(p.region) if p.region else _region(rng, cfg)
    return Event(
        t=t,
        kind=p.kind,
        region=region,
        count=_count(p.kind, cfg, region),
        duration_s=p.duration_s,
        extra_latency_s=p.extra_latency_ms / 1000,
        replace_s=p.replace_minutes * 60,
        silent=p.silent,
    )


def draw(cfg: SimConfig, seed: int, horizon_s: float) -> list[Event]:
    """Every failure of ``cfg`` within ``horizon_s``, in time order."""
    out: list[Event] = []
    for i, p in enumerate(cfg.failures):
        rng = random.Random(f"{seed}:{i}:{p.kind}")
        for h in p.at_hours:
            if h * HOUR < horizon_s:
                out.append(_event(p, h * HOUR, rng, cfg))
        rate = rate_per_hour(p, cfg) / HOUR
        t = rng.expovariate(rate) if rate > 0 else horizon_s
        while t < horizon_s:
            out.append(_event(p, t, rng, cfg))
            t += rng.expovariate(rate)
    return sorted(out, key=lambda e: e.t)
