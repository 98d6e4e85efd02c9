"""When a joiner's state copy may overlap the survivors' first step. A pure function.

In an overlapped copy (``runtime/member/copy_overlap.py``) the epoch's first step is planned with
no slot on any receiver (``plan.idle_plan``): the holders compute it while they serve
their committed state on a second process group, and a receiver enters the step's
reduction, with no slot of its own, once its copy is in. The result is the same bits as a
blocking copy's because the slots, not the members, fix the math; what the overlap needs
from the step is narrower:

- the exact reduction (``train.reduction = "exact"``): its sum does not depend on which
  member holds which slot, and a member with no slot adds nothing to it. The chain folds
  along the ranks and each rank must hold a slot (its ``_attempt`` reads its last one);
- exponents carried or streamed (``train.reduction_exponents``): one accumulator, opened
  and finished with no slot at all; ``step`` keeps every slot's buffer and opens with a
  MAX round, which a holder would enter before its copy is served;
- parameters whole on every rank (``train.shard_params`` false where
  ``train.shard_degree`` > 1): sharded at rest, every slot's gathers are the replica
  group's collectives, which a receiver without its shard's parameters cannot serve. A
  replica group's optimizer shards are exchanged after the copy (a holder does it at its
  gate, before the first step's reduction: the exchange is on the epoch's group, behind
  the copy's operations, and only the update needs it). Not with
  ``train.shard_reduce_slots = "each"``: every slot's buckets are reduce-scattered inside
  the group as its backward finishes them, collectives a holder would enter before its
  copy is served (the copy, the exchange and the rounds would meet the receiver's in
  another order: measured, every collective of the epoch timed out);
- no DiLoCo (``outer.replicas`` = 0): an outer step's pseudo-gradients go through their
  own gather (int8) and the outer state's first step is not a plain slot step.

Everything else copies blocking, as before: the members wait at the epoch's start.
"""

from __future__ import annotations

from perdure.runtime.config import OuterConfig, TrainConfig


def overlap_refusal(train: TrainConfig, outer: OuterConfig) -> str | None:
    """Why a state copy of this config must block the epoch's start; None: it may overlap
    the first step (see the module's docstring)."""
    if train.reduction != "exact":
        return f"train.reduction = {train.reduction!r} (the overlap needs 'exact')"
    if train.reduction_exponents not in ("carried", "streamed"):
        return (
            f"train.reduction_exponents = {train.reduction_exponents!r} (the overlap needs "
            "'carried' or 'streamed')"
        )
    if train.shard_degree > 1 and train.shard_params:
        return (
            f"train.shard_params = true with train.shard_degree = {train.shard_degree} "
            "(the overlap needs the parameters whole on every rank)"
        )
    if train.shard_degree > 1 and train.shard_reduce_slots == "each":
        return (
            f"train.shard_reduce_slots = 'each' with train.shard_degree = {train.shard_degree} "
            "(every slot's rounds are collectives before a holder's copy is served)"
        )
    if outer.on:
        return f"outer.replicas = {outer.replicas} (DiLoCo copies blocking)"
    return None


def overlaps(train: TrainConfig, outer: OuterConfig) -> bool:
    """Whether a state copy of this config overlaps the epoch's first step."""
    return overlap_refusal(train, outer) is None
