"""One member's side of its replica group for one membership epoch.

The group is ``k`` consecutive ranks of the plan (``owners.group_of``), with a process
group of its own. Every rank computes whole slots with the whole parameters and takes part
in the exact (or chain) reduction over every member, so every rank holds the step's
gradient sum. It then updates only the parameters its shard owns (the optimizer skips a
parameter whose ``.grad`` is None, so it keeps no state for the others) and the owners
broadcast the updated parameters to their group: the same bits on every rank, for any k.

A periodic checkpoint does not gather: each rank learns only the other shards' layout (a
skeleton of ``meta`` tensors) and writes the part of its own shard's state that the plan
gives it (``checkpoint.plan``'s holders: the ranks of every group that own the shard).

The final hash streams the other shards' tensors through the group one at a time
(``fetcher``), so no rank ever holds the whole optimizer state.

Limit of this step: parameters and the gradient sum stay whole on every rank (what
shrinks by k is the optimizer state). ``param_gather.py`` holds the mechanism that shards
the parameters at rest; it is tested on its own and not used here yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from perdure.checkpoint.tensors import flatten
from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.transfer import (
    broadcast_state,
    pack,
    pack_skeleton,
    unpack,
    unpack_skeleton,
)
from perdure.runtime.shard_plan import ALL, merge, owners, part, shard_of, sources


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order of the optimizer state's indices."""
    return [p for g in optimizer.param_groups for p in g["params"]]


class Shards:
    """Ownership, the update's exchange and the optimizer state's moves of one member."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        k: int,
        rank: int,
        group: Comm,
        timeout: timedelta,
    ) -> None:
        self.params = list(params)
        self.k, self.rank, self.group, self.timeout = k, rank, group, timeout
        self.owner = owners([p.numel() for p in self.params], k)
        self.mine = shard_of(rank, k)
        self.received: tuple[int, int] | None = None
        """After ``exchange``: (the rank it received its shard from, the bytes), if any."""

    # -- the step --------------------------------------------------------------------------

    def drop_foreign_grads(self) -> None:
        """Before the optimizer's step: only this shard's parameters are updated here."""
        for p, j in zip(self.params, self.owner, strict=True):
            if j != self.mine:
                p.grad = None

    def sync_params(self) -> None:
        """After it: each shard's owner broadcasts its updated parameters to the group (as
        bytes, so any dtype travels), and the others copy them in."""
        for j in range(self.k):
            owned = [p for p, o in zip(self.params, self.owner, strict=True) if o == j]
            if owned:
                self._broadcast_params(j, owned)

    def _broadcast_params(self, j: int, owned: list[torch.Tensor]) -> None:
        sizes = [p.numel() * p.element_size() for p in owned]
        dev = self.group.device
        if j == self.mine:
            views = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in owned]
            flat = torch.cat([v.to(dev) for v in views])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
        pg, t = self.group.pg, self.timeout
        self.group.call(lambda: pg.broadcast(flat, j).wait(t))
        if j == self.mine:
            return
        offset = 0
        with torch.no_grad():
            for p, n in zip(owned, sizes, strict=True):
                p.copy_(flat[offset : offset + n].view(p.dtype).view(p.shape))  # to p's device
                offset += n

    # -- the optimizer state ---------------------------------------------------------------

    def fetcher(self, whole: dict[str, Any]) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """For ``state_digest`` over a ``skeleton``: each tensor of a shard, broadcast by
        its owner to the group as it is hashed (every rank of the group calls it for every
        tensor, in the same order), so no rank holds more than one foreign tensor at once."""
        shard_of_key = self._key_shards(whole)
        dev = self.group.device

        def fetch(key: str, t: torch.Tensor) -> torch.Tensor:
            j = shard_of_key.get(key)
            if j is None:
                return t  # held whole by every rank
            if j == self.mine:
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8).to(dev)
            else:
                flat = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=dev)
            pg, timeout = self.group.pg, self.timeout
            self.group.call(lambda: pg.broadcast(flat, j).wait(timeout))
            return t if j == self.mine else flat.view(t.dtype).view(t.shape)

        return fetch

    def skeleton(self, state: dict[str, Any]) -> dict[str, Any]:
        """The whole optimizer state's structure, with this rank's shard real and the
        others as ``meta`` tensors (dtypes and shapes from their owners; no bytes move)."""
        parts = []
        for j in range(self.k):
            own = part(state, self.owner, j)
            mine = pack_skeleton(own) if j == self.mine else None
            head, _ = broadcast_state(self.group, j, mine, self.timeout)
            parts.append(own if j == self.mine else unpack_skeleton(head))
        return merge(parts)

    def holders(self, state: dict[str, Any], world: int) -> dict[str, tuple[int, ...]]:
        """For each tensor of a shard's optimizer state (as a checkpoint names it), the
        ranks of a ``world``-member epoch that hold it: that shard's rank in every group."""
        ranks = [tuple(r for r in range(world) if shard_of(r, self.k) == j) for j in range(self.k)]
        return {key: ranks[j] for key, j in self._key_shards(state).items()}

    def _key_shards(self, state: dict[str, Any]) -> dict[str, int]:
        """The shard of each tensor of ``state`` that one shard alone holds, by its name
        (the tensors of every part, such as a tensor-valued param group, are not listed)."""
        common = set(flatten({}, part(state, self.owner, -1))[0])
        out: dict[str, int] = {}
        for j in range(self.k):
            for key in flatten({}, part(state, self.owner, j))[0]:
                if key not in common:
                    out[key] = j
        return out

    def exchange(self, epoch: Comm, held: int, state: dict[str, Any]) -> dict[str, Any] | None:
        """At an epoch's start, over the whole epoch: every member that lacks its shard's
        state receives it from the lowest rank that has it. ``held``: what this rank holds
        (a shard, ``ALL``, or ``NONE``); returns the state this rank must load (its shard
        only), or None when it holds exactly that already."""
        dev = epoch.device
        mine = torch.tensor([held], dtype=torch.int64, device=dev)
        outs = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(epoch.size)]
        epoch.call(lambda: epoch.pg.allgather([outs], [mine]).wait(self.timeout))
        holdings = [int(o[0]) for o in outs]
        got: dict[str, Any] | None = None
        for j, src in sorted(sources(holdings, self.k).items()):
            own = part(state, self.owner, j)
            payload = pack({}, own, {}, epoch.device) if self.rank == src else None
            head, blob = broadcast_state(epoch, src, payload, self.timeout)
            if j == self.mine and held not in (j, ALL):
                got = unpack(head, blob)[1]
                self.received = (src, int(blob.numel()) + len(head))
        if got is not None:
            return part(got, self.owner, self.mine)
        if held == ALL:
            return part(state, self.owner, self.mine)
        return None
