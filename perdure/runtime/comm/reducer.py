"""The seam every reduction plugs into: sum the slot gradients of an epoch's members.

A reducer is built per membership epoch (it knows the member's rank and the group's size)
and owns its scratch space, which lives as long as the epoch: a collective abandoned on the
comm thread may still write into it after the step loop has moved on. The math of the sum
(its rounding) is the reducer's, so ``train.reduction`` is in the config hash.

A new reduction is one new module with a class that satisfies :class:`Reducer`, and one
entry in :data:`REDUCERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Protocol

import torch

from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.scatter import Scatter
from perdure.runtime.config import TrainConfig


class Reducer(Protocol):
    """Sums every member's slot buffers into one buffer, identically on every member.

    ``carried`` says which of two ways the step feeds it: False, one buffer per slot,
    handed whole to :meth:`start` (the chain, the ``step`` exponents); True, one buffer
    for every slot, each slot added as it finishes and the last streamed behind its
    backward, rounded against exponents carried from the previous step
    (:class:`CarriedReduction`: ``carried`` and ``streamed`` exponents)."""

    carried: bool

    @property
    def scatters(self) -> bool:
        """Whether the sum it returns is whole only in this member's range of the replica
        group's reduce-scatter (``comm/scatter.py``): what every rank needs whole (the
        reruns' verdicts) then goes through a flat reducer of its own."""
        ...

    def start(
        self,
        comm: Comm,
        bufs: Sequence[torch.Tensor],
        *,
        timeout: timedelta,
        ready: Readiness | None = None,
        abort: Callable[[], bool] = lambda: False,
        send_delay_s: float = 0.0,
    ) -> Future[torch.Tensor]:
        """Start the reduction of this member's ``bufs`` (its slots, in slot order) on the
        comm thread. ``ready`` follows the last buffer while its backward still fills it;
        ``send_delay_s`` is injected link latency (the ``delay`` fault)."""
        ...


class CarriedReduction(Reducer, Protocol):
    """A reducer with carried state (``Trainer.exponents``): the step opens a pass against
    :meth:`used` of the prediction, adds its slots, and takes the verdict of
    :meth:`accepts`; a refused pass is computed again against :meth:`fitted` maxima, which
    cannot fail. ``P`` is the prediction's type, ``M`` the maxima's."""

    def open(
        self, like: torch.Tensor, exps: Any, *, adds: int, rounds: int = 0, resume: Any = None
    ) -> bool:
        """Begin a pass rounded against ``exps`` (None: measure the maxima only) that will
        :meth:`add` ``adds`` slots before :meth:`finish` (where it is 0 the reducer may
        keep its integers in ``like`` itself: the member's one slot is converted in place).
        ``rounds``: the most slots a rank of the member's replica group computes in the
        pass (1 without groups). ``resume``: a :meth:`partial` of an abandoned pass of the
        same step (opaque to the step); True where the pass starts from it, its slots
        then counted among ``adds`` and not added again."""
        ...

    def partial(self) -> Any:
        """After an abandoned pass: the sum of the slots it holds (those added, or every
        one once the last is on the wire where the reducer sends from a copy), kept for a
        later pass of the same step (salvage across a membership change); None where
        this pass cannot give it."""
        ...

    def begin_slot(
        self, comm: Comm, *, timeout: timedelta, abort: Callable[[], bool], stream: bool
    ) -> Readiness | None:
        """Before a slot that is not this member's last is computed into ``like``: the
        readiness its backward reports to, where the reducer takes the slot's buckets as
        they finish (``train.shard_reduce_slots = "each"``, and ``stream``), else None."""
        ...

    def add(self, buf: torch.Tensor) -> None:
        """A finished slot that is not this member's last."""
        ...

    def skip(self, comm: Comm, *, timeout: timedelta, abort: Callable[[], bool]) -> None:
        """A throwaway pass of this member (a padding slot of ``train.shard_params``),
        which adds nothing; where every slot is reduced in rounds its group must match,
        a round of zeros."""
        ...

    def finish(
        self,
        comm: Comm,
        out: torch.Tensor,
        *,
        timeout: timedelta,
        last: torch.Tensor | None = None,
        ready: Readiness | None = None,
        abort: Callable[[], bool] = lambda: False,
        send_delay_s: float = 0.0,
    ) -> Future[tuple[torch.Tensor | None, Any]]:
        """Every member's sum (None for a measuring pass) and the step's maxima; ``last``
        follows ``ready`` while its backward fills it."""
        ...

    def used(self, pred: Any) -> Any: ...

    def accepts(self, pred: Any, maxima: Any) -> bool: ...

    def fitted(self, maxima: Any) -> Any: ...

    def predict(self, pred: Any | None, maxima: Any) -> Any: ...


def uses_tiers(train: TrainConfig, hierarchical: bool) -> bool:
    """Whether an epoch's group adds the regions' tiers (``cluster.hierarchical_reduce``):
    only the exact reduction sums in them (integers: any grouping is the same bits)."""
    return hierarchical and train.reduction == "exact"


def direct_leaders(setting: str, diloco: bool) -> bool:
    """Whether the regions' leaders combine by the direct exchange (else by the backend's
    all-reduce): ``cluster.cross_region_reduce``, ``auto`` being direct except for
    DiLoCo's outer step (``diloco``), which is bandwidth-bound."""
    return setting == "direct" or (setting == "auto" and not diloco)


def make_reducer(
    train: TrainConfig,
    rank: int,
    size: int,
    scatter: Scatter | None = None,
    *,
    tiered: bool = False,
) -> Reducer:
    """The reducer that ``train.reduction`` selects, for one epoch's member; ``scatter``:
    its replica group's reduce-scatter (the exact reduction only); ``tiered``: the epoch
    reduces in region tiers (``comm/tiers.py``), where the streamed form does not scatter."""
    from perdure.runtime.comm.chain import ChainReducer
    from perdure.runtime.comm.exact import ExactReducer

    assert scatter is None or train.scatters, "a scatter for a reduction that cannot use it"
    if train.reduction == "chain":
        return ChainReducer(rank, size)
    if train.reduction == "exact" and train.reduction_exponents == "streamed":
        from perdure.runtime.comm.streamed import StreamedReducer

        bits, block = train.reduction_bits, train.reduction_block
        each = train.shard_reduce_slots == "each" and scatter is not None and not tiered
        return StreamedReducer(
            rank, size, slots=train.slots, bits=bits, block=block, scatter=scatter, each=each
        )
    if train.reduction == "exact" and train.reduction_exponents == "carried":
        from perdure.runtime.comm.carried import CarriedReducer

        block = train.reduction_block
        return CarriedReducer(rank, size, slots=train.slots, block=block, scatter=scatter)
    if train.reduction == "exact":
        bits, block = train.reduction_bits, train.reduction_block
        return ExactReducer(rank, size, slots=train.slots, bits=bits, block=block, scatter=scatter)
    raise ValueError(f"train.reduction: unknown reduction {train.reduction!r}")
