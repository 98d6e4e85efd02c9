"""Replica groups (``train.shard_degree``), the pure part: which rank of a group owns which
parameter, who sends which shard when an epoch begins, and optimizer state dicts cut and
merged by shard. Pure functions of sizes, ranks and what each rank holds (the coordinator's
policy and the trainer use them; ``shard_group.py`` runs them on process groups).

A parameter is owned whole: its optimizer state lives on one rank of each group, which
updates it with the optimizer's own kernels on the whole tensor, exactly as an unsharded
replica would. Splitting tensors along a dimension (FSDP2's ``Shard(0)``) would save more
memory, but it changes the bits of anything that is not elementwise: the norms of gradient
clipping, and optimizers that look at a whole matrix (Shampoo, Muon, Adafactor's factored
moments). Whole-parameter ownership keeps ``train.shard_degree`` out of the math.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

ALL = -1
"""A rank's holding when it has every shard's state (k = 1, the seed's initial state, a
checkpoint just loaded)."""
NONE = -2
"""A rank's holding when it has no current optimizer state."""


def owners(sizes: Sequence[int], k: int) -> list[int]:
    """The shard (0..k-1) that owns each parameter, balanced by size: largest first to the
    lightest shard (ties: the lower shard; equal sizes: the lower index first)."""
    if k < 1:
        raise ValueError(f"shard degree must be >= 1 (got {k})")
    load = [0] * k
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(k), key=lambda j: (load[j], j))
        out[i] = j
        load[j] += sizes[i]
    return out


def unit_owners(units: Sequence[Sequence[int]], sizes: Sequence[int], k: int) -> list[int]:
    """``owners`` for parameters sharded at rest: each unit (a list of parameter indices;
    ``param_gather.units``) owned whole by one shard, so that gathering it is one
    broadcast, balanced by the units' sizes the same way. A parameter in several units (a
    tied one) belongs to the first; one in none is a unit of its own."""
    first: dict[int, int] = {}
    for u, idx in enumerate(units):
        for i in idx:
            first.setdefault(i, u)
    groups = [[i for i in idx if first[i] == u] for u, idx in enumerate(units)]
    groups = [g for g in groups if g] + [[i] for i in range(len(sizes)) if i not in first]
    by_group = owners([sum(sizes[i] for i in g) for g in groups], k)
    out = [0] * len(sizes)
    for g, j in zip(groups, by_group, strict=True):
        for i in g:
            out[i] = j
    return out


def contiguous_owners(
    items: Sequence[Sequence[int]], sizes: Sequence[int], k: int
) -> list[int] | None:
    """Owners (by position) that give each shard one contiguous run of positions, for a
    reduce-scatter of a flat buffer laid out in position order (``train.shard_reduce``).
    ``items``: the indivisible groups of positions (a gather unit; else each position
    alone); ``sizes``: each position's size. The runs minimise the largest shard's load,
    and among those cuts the earliest fill (a pure function of the inputs). None when the
    items do not tile the positions in order (an item that is not one interval, or two
    that interleave): such an ownership cannot be contiguous."""
    spans = _item_spans(items, len(sizes))
    if spans is None:
        return None
    loads = [sum(sizes[lo:hi]) for lo, hi in spans]
    cap = _least_capacity(loads, k)
    out = [0] * len(sizes)
    shard, held = 0, 0
    for (lo, hi), load in zip(spans, loads, strict=True):
        if held + load > cap and held > 0:
            shard, held = shard + 1, 0
        held += load
        out[lo:hi] = [shard] * (hi - lo)
    assert shard < max(k, 1), "the least capacity fits every item in k runs"
    return out


def _item_spans(items: Sequence[Sequence[int]], n: int) -> list[tuple[int, int]] | None:
    """The items as position intervals in order, if they tile ``0..n-1``; else None."""
    spans = sorted((min(it), max(it) + 1, len(set(it))) for it in items if it)
    at = 0
    for lo, hi, count in spans:
        if lo != at or hi - lo != count:
            return None
        at = hi
    return [(lo, hi) for lo, hi, _ in spans] if at == n else None


def _least_capacity(loads: Sequence[int], k: int) -> int:
    """The smallest largest-run load that cuts ``loads`` into at most ``k`` runs."""
    if k < 1:
        raise ValueError(f"shard degree must be >= 1 (got {k})")
    lo, hi = max(loads, default=0), sum(loads)
    while lo < hi:
        mid = (lo + hi) // 2
        runs, held = 1, 0
        for x in loads:
            if held + x > mid and held > 0:
                runs, held = runs + 1, 0
            held += x
        lo, hi = (lo, mid) if runs <= k else (mid + 1, hi)
    return lo


def shard_ranges(owner: Sequence[int], numels: Sequence[int], k: int) -> list[tuple[int, int]]:
    """Each shard's value range ``[lo, hi)`` in a flat buffer of the positions in order,
    for a contiguous ownership (``contiguous_owners``: owners never decrease along the
    positions); an empty shard gets an empty range where it would begin."""
    assert all(a <= b for a, b in itertools.pairwise(owner)), "not contiguous"
    out, offset, pos = [], 0, 0
    for j in range(k):
        lo = offset
        while pos < len(owner) and owner[pos] == j:
            offset += numels[pos]
            pos += 1
        out.append((lo, offset))
    return out


def shard_of(rank: int, k: int) -> int:
    """The shard a member owns: its position inside its group (groups are consecutive
    ranks of the plan: ``rank // k``)."""
    return rank % k


def group_of(rank: int, k: int) -> int:
    return rank // k


def sources(held: Sequence[int], k: int) -> dict[int, int]:
    """For each shard some member must receive, the rank that sends it: the lowest rank
    that holds it (or holds everything). ``held[r]``: what rank r holds (a shard, ``ALL``
    or ``NONE``). Raises ``LookupError`` naming a shard that nobody holds."""
    out: dict[int, int] = {}
    for j in range(k):
        needers = [r for r in range(len(held)) if shard_of(r, k) == j and held[r] not in (j, ALL)]
        if not needers:
            continue
        have = [r for r in range(len(held)) if held[r] in (j, ALL)]
        if not have:
            raise LookupError(f"optimizer shard {j} of {k} is held by no member")
        out[j] = have[0]
    return out


def complete(held: Sequence[int], k: int, size: int) -> bool:
    """Whether members holding ``held`` (any order) can give every rank of a ``size``-member
    epoch its shard: the coordinator's check before it starts an epoch from live state."""
    needed = {shard_of(r, k) for r in range(size)}
    return ALL in held or needed <= set(held)


# -- optimizer state dicts cut and merged by shard (plain dicts: no torch calls) ---------
#
# A torch optimizer's ``state_dict()`` holds ``"state"`` (per parameter index, in
# param-group order) and ``"param_groups"`` (hyperparameters, identical on every rank). A
# shard's part keeps the param groups and the states of the parameters it owns; a recipe's
# scheduler state (under ``"scheduler"``) is identical on every rank and travels with
# every part.


def part(state: dict[str, Any], owner: Sequence[int], shard: int) -> dict[str, Any]:
    """The part of ``state`` that shard ``shard`` owns."""
    kept = {i: s for i, s in state["state"].items() if owner[int(i)] == shard}
    return {**state, "state": kept}


def merge(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One state from the parts of every shard (their param groups are equal)."""
    assert parts, "merge of no parts"
    states: dict[Any, Any] = {}
    for p in parts:
        states.update(p["state"])
    return {**parts[0], "state": dict(sorted(states.items(), key=lambda kv: int(kv[0])))}
