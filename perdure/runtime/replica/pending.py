"""Where a replica sharded at rest takes its parameters from once it knows its shard.

With ``train.shard_params`` a worker learns which shard it owns only when an epoch starts
(its rank in the plan). Until then it holds every shard *virtually*: its parameters are at
rest (zero-byte storages) and a :class:`Pending` source makes any of them resident on
demand, so no rank ever holds the whole model:

- :class:`FromSeed`: the run's initial parameters, drawn module by module from seeds of
  their own (``task.init = "per_module"``; ``deferred.SeedInit``);
- :class:`FromCheckpoint`: a checkpoint opened without its tensors
  (``checkpoint/ranges.py``): each parameter is read from its own byte ranges of the
  files straight into its storage, so a rank reads, and holds, its shard only, whatever
  layout wrote the checkpoint.

The trainer fills its own shard at the epoch's start (``Trainer.keep_shard``) and, where
it is the lowest holder of a shard another member lacks, that shard for a moment while it
is sent (``Trainer.filled``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from perdure.checkpoint.ranges import Lazy
from perdure.checkpoint.tensors import MODEL
from perdure.runtime.replica.deferred import SeedInit, make_resident


class Pending(Protocol):
    """A source of any of a replica's parameters, filled in place."""

    @property
    def peak_bytes(self) -> int:
        """The most parameter bytes its fills held at once (a seed initialises a module's
        parameters together; 0 for a checkpoint, whose tensors are copied one by one)."""
        ...

    def fill(self, params: Sequence[torch.Tensor]) -> None:
        """Give ``params`` (parameters at rest, the model's own objects) their bytes."""
        ...


class FromSeed:
    """The initial parameters, initialised per module from the seed."""

    def __init__(self, seeded: SeedInit) -> None:
        self.seeded = seeded

    def fill(self, params: Sequence[torch.Tensor]) -> None:
        self.seeded.fill(params)

    @property
    def peak_bytes(self) -> int:
        return self.seeded.peak_bytes


class FromCheckpoint:
    """A checkpoint's model tensors, each read by byte range when it is filled."""

    def __init__(self, module: nn.Module, lazy: Lazy) -> None:
        self.lazy = lazy
        self.names: dict[int, str] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            self.names.setdefault(id(t), name)  # a tied parameter: its first name

    @property
    def peak_bytes(self) -> int:
        return 0

    def fill(self, params: Sequence[torch.Tensor]) -> None:
        direct: list[tuple[str, torch.Tensor]] = []
        staged: list[tuple[str, torch.Tensor]] = []
        for p in params:
            make_resident(p)
            key = MODEL + self.names[id(p)]
            cpu = p.device.type == "cpu" and p.is_contiguous()
            (direct if cpu else staged).append((key, p))
        with torch.no_grad():
            self.lazy.reader.fill([(k, p.data) for k, p in direct])
            for key, p in staged:  # another device: through one tensor's CPU copy
                p.copy_(self.lazy.reader.read(key))
