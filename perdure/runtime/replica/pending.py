"""Where a replica sharded at rest takes its parameters from once it knows its shard.

With ``train.shard_params`` a worker learns which shard it owns only when an epoch starts
(its rank in the plan). Until then it holds every shard *virtually*: its parameters are at
rest (zero-byte storages) and a :class:`Pending` source makes any of them resident on
demand, so no rank ever holds the whole model:

- :class:`FromSeed`: the run's initial parameters, drawn module by module from seeds of
  their own (``task.init = "per_module"``; ``deferred.SeedInit``);
- :class:`FromCheckpoint`: a checkpoint's model tensors, mapped (``load_checkpoint``'s
  default), so only the bytes read are ever in memory.

The trainer fills its own shard at the epoch's start (``Trainer.keep_shard``) and, where
it is the lowest holder of a shard another member lacks, that shard for a moment while it
is sent (``Trainer.filled``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

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
    """A checkpoint's model tensors (mapped), by the module's state dict names."""

    def __init__(self, module: nn.Module, model: Mapping[str, torch.Tensor]) -> None:
        self.model = model
        self.names: dict[int, str] = {}
        for name, t in module.state_dict(keep_vars=True).items():
            self.names.setdefault(id(t), name)  # a tied parameter: its first name

    @property
    def peak_bytes(self) -> int:
        return 0

    def fill(self, params: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for p in params:
                make_resident(p)
                p.copy_(self.model[self.names[id(p)]])
