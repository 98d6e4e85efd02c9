"""The ``[ray]`` section: how the Ray launcher (``launch/ray.py``) reaches a cluster and
places a run's processes on it.

It lives here rather than beside the launcher because ``perdure.launch`` imports the run
config, not the reverse (``tests/unit/test_layering.py``), as ``RunOptions`` does. Nothing in it
changes the math: where a process runs is a scheduling decision.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from perdure.config import Checker

_ADDRESS = re.compile(r"^(ray://)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


@dataclass(kw_only=True, frozen=True)
class RayConfig:
    """Used by ``perdure run --launcher ray`` only: the coordinator, the standby, every
    worker and spare run as Ray actors placed by region (see docs/deployment.md)."""

    address: str = "auto"
    """The cluster to run on: ``HOST:PORT`` of its head (the GCS port of ``ray start
    --head``), ``auto`` (``$RAY_ADDRESS``, else the cluster ``ray start`` runs on this
    machine), or ``local`` (a private one-node Ray started for this run, every configured
    region's resource on it, stopped at its end). ``ray://HOST:PORT`` (Ray Client) is
    accepted but untested here. ``perdure run --ray-address`` overrides it."""
    namespace: str = "perdure"
    """Ray namespace of the run's actors."""
    placement: Literal["resource", "label"] = "resource"
    """How a process is kept in its region: ``resource`` asks for a small amount of the
    custom resource ``<resource_prefix><region>`` (a region's nodes are started with
    ``--resources '{"region:eu_west": 1}'``, as Ray's own ``node:<ip>`` resource is used);
    ``label`` asks for nodes whose label ``<label>`` is the region (``ray start --labels
    region=eu_west``; Ray's label selectors, experimental in Ray 2.60)."""
    resource_prefix: str = "region:"
    """With ``placement = "resource"``: the custom resource of region R is this plus R."""
    label: str = "region"
    """With ``placement = "label"``: the node label whose value names the region."""
    worker_cpus: float = 1.0
    """Ray CPUs each worker or spare reserves (0 reserves none: Ray then packs any number
    of workers onto a node). Coordinators reserve none."""
    worker_gpus: float = 0.0
    """Ray GPUs each worker reserves; Ray sets ``CUDA_VISIBLE_DEVICES`` in the worker's
    actor and the worker process inherits it."""
    start_timeout_s: float = 120.0
    """How long a process may wait to be placed on a node and started (a region whose
    nodes are full or gone) before the launcher gives up, naming what it asked Ray for."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(
            self.address in ("auto", "local") or bool(_ADDRESS.match(self.address)),
            "address",
            "must be HOST:PORT, ray://HOST:PORT, 'auto' or 'local'",
            self.address,
        )
        c.check(bool(self.namespace.strip()), "namespace", "must not be empty", self.namespace)
        c.check(
            bool(self.resource_prefix.strip()),
            "resource_prefix",
            "must not be empty",
            self.resource_prefix,
        )
        c.check(bool(self.label.strip()), "label", "must not be empty", self.label)
        c.non_negative("worker_cpus", self.worker_cpus)
        c.non_negative("worker_gpus", self.worker_gpus)
        c.positive("start_timeout_s", self.start_timeout_s)
        c.done()
