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

With ``train.shard_params`` the parameters are sharded at rest too (``param_gather.py``):
a rank keeps its shard's parameters only, gathers the others while a slot runs, and skips
the broadcast after the update (nobody else keeps them). The parameters then travel with
their shard's optimizer state (``exchange``), a checkpoint's model tensors are written by
their shard's holders like the optimizer's, and the final hash streams them too.

With ``train.shard_reduce`` (``scatter``, or ``auto`` where possible) each shard owns
one contiguous range of the slot buffer's order (``shard_plan.contiguous_owners``), the
gradient sum is reduce-scattered (``comm/scatter.py``) and is correct on a rank's own
range only: gradient clipping then sums its per-parameter norms over the group
(:meth:`Shards.clip`). Limit: the accumulator and the converted buffer keep their whole
size (only their own range and the tail are final).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from perdure.checkpoint.tensors import MODEL, flatten
from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.scatter import Scatter
from perdure.runtime.comm.swarm import CopyJob, Received, SwarmCopy
from perdure.runtime.comm.transfer import broadcast_state, pack_skeleton, unpack_skeleton
from perdure.runtime.replica.param_gather import ParamGather, make_resident, unit_budget, units
from perdure.runtime.shard_plan import (
    ALL,
    contiguous_owners,
    group_of,
    merge,
    owners,
    part,
    shard_of,
    shard_ranges,
    sources,
    unit_owners,
)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in the order of the optimizer state's indices."""
    return [p for g in optimizer.param_groups for p in g["params"]]


Fill = Callable[[Sequence[torch.Tensor]], contextlib.AbstractContextManager[None]]
"""``fill(params)``: a context inside which ``params`` are resident (``Trainer.filled``)."""


def _as_is(_params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


SYNC_GRACE_S = 1.0
"""How long an update's parameter exchange may go on once the epoch changed (the group's
other ranks, if they are in it too, finish in milliseconds; one that left the step never
comes)."""


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
        module: nn.Module | None = None,
        layout: Sequence[torch.Tensor] | None = None,
        prefetch: bool = True,
    ) -> None:
        """``layout``: the parameters in the slot buffer's order (``SlotEngine.params``),
        to give each shard one contiguous range of it for a reduce-scatter
        (``train.shard_reduce = "scatter"``); ``ranges`` stays None where the ownership
        cannot be contiguous (gather units that interleave in that order)."""
        self.params = list(params)
        self.prefetch = prefetch
        """Sharded at rest: whether the gathers are prefetched (``train.shard_prefetch``)."""
        self.k, self.rank, self.group, self.timeout = k, rank, group, timeout
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.unit_bytes: int | None = None
        """Sharded at rest: the gather units' budget (``param_gather.units``)."""
        self.ranges: list[tuple[int, int]] | None = None
        """Each shard's value range of the slot buffer's gradient part (contiguous
        ownership for the reduce-scatter), or None."""
        self.grad_owner: dict[int, int] = {}
        """With ``ranges``: the shard whose range holds each slot-buffer parameter's
        gradient, by ``id`` (what :meth:`clip` sums norms by)."""
        self.why_whole: str | None = None
        """Why a ``layout`` given got no contiguous ranges."""
        self.scatter: Scatter | None = None
        """This epoch's reduce-scatter (``comm/scatter.py``), once built."""
        self._scatter_comms: list[Comm] = []
        self.owner = self._owners(module, layout)
        self.mine = shard_of(rank, k)
        self.received: tuple[int, int] | None = None
        """After ``exchange``: (the rank it received its shard from, the bytes), if any."""
        self.model_keys = {} if module is None else self._model_keys(module)
        """With the parameters sharded at rest (a ``module`` given): the shard of each of
        its state dict's parameters, by checkpoint name (``model/<name>``; a tied
        parameter under each of its names)."""

    def _owners(self, module: nn.Module | None, layout: Sequence[torch.Tensor] | None) -> list[int]:
        """Whole parameters balanced by size; sharded at rest, whole gather units (one
        broadcast each: ``shard_plan.unit_owners``); for a reduce-scatter, contiguous runs
        of the slot buffer (units kept whole) where that is possible."""
        sizes = [p.numel() for p in self.params]
        groups = None
        if module is not None:
            nbytes = [p.numel() * p.element_size() for p in self.params]
            self.unit_bytes = unit_budget(nbytes, self.k)
            groups = [idx for _, idx in units(module, self._index, nbytes, self.unit_bytes)]
        if layout is not None:
            found = self._contiguous(layout, groups)
            if found is not None:
                return found
        return owners(sizes, self.k) if groups is None else unit_owners(groups, sizes, self.k)

    def _contiguous(
        self, layout: Sequence[torch.Tensor], groups: list[list[int]] | None
    ) -> list[int] | None:
        """Owners giving each shard one run of ``layout`` (and ``self.ranges``), or None."""
        pos = {id(p): i for i, p in enumerate(layout)}
        if any(id(p) not in pos for p in self.params):
            self.why_whole = "an optimized parameter is outside the slot buffer"
            return None
        items: list[list[int]] = []
        covered: set[int] = set()
        for g in groups or []:  # a tied parameter stays in its first unit
            it = [pos[id(self.params[i])] for i in g if pos[id(self.params[i])] not in covered]
            covered.update(it)
            items += [it] if it else []
        items += [[i] for i in range(len(layout)) if i not in covered]
        numels = [p.numel() for p in layout]
        by_pos = contiguous_owners(items, numels, self.k)
        if by_pos is None:
            self.why_whole = "the gather units interleave in the slot buffer's order"
            return None
        self.ranges = shard_ranges(by_pos, numels, self.k)
        self.grad_owner = {id(p): by_pos[i] for i, p in enumerate(layout)}
        return [by_pos[pos[id(p)]] for p in self.params]

    def build_scatter(self, epoch: Comm, store: Any, world: int, numel: int, size: int) -> None:
        """This epoch's reduce-scatter, where the ranges are contiguous: a process group of
        the replica group for it alone (the gathers' group keeps its own order of
        collectives) and, with several groups, one of this shard's ranks across them.
        ``numel`` and ``size``: the slot buffer's gradient part and whole length. Every
        member of the epoch calls it, in the same order of groups (no cycle of waits)."""
        if self.ranges is None:
            return
        g, j = group_of(self.rank, self.k), self.mine
        self._scatter_comms = [epoch.subgroup(store, f"scatter{g}", j, self.k)]
        if world > self.k:
            self._scatter_comms.append(epoch.subgroup(store, f"cross{j}", g, world // self.k))
        cross = self._scatter_comms[1].pg if world > self.k else None
        pg = self._scatter_comms[0].pg
        gloo = isinstance(pg, dist.ProcessGroupGloo)
        first: Literal["reduce_scatter", "all_reduce"] = "all_reduce" if gloo else "reduce_scatter"
        self.scatter = Scatter(pg, cross, tuple(self.ranges), j, numel, size, first)

    def close(self) -> None:
        for c in [self.group, *self._scatter_comms]:
            c.close()

    @property
    def scattered(self) -> bool:
        """Whether this epoch's reduction reduce-scatters (set by the worker once it has
        built the scatter): the gradients are then correct on their owners only."""
        return self.scatter is not None

    @property
    def own_range(self) -> tuple[int, int] | None:
        """The gradient values whose sum this rank receives (reduce-scattered), else None:
        the rest of its buffer holds its local partial only."""
        return None if self.scatter is None else self.scatter.mine

    @property
    def shard_params(self) -> bool:
        return bool(self.model_keys)

    def _model_keys(self, module: nn.Module) -> dict[str, int]:
        index = self._index
        named = {n: t for n, t in module.state_dict(keep_vars=True).items() if id(t) in index}
        self._named: dict[str, torch.Tensor] = {}
        """Each parameter under its first state dict name (what ``exchange`` sends)."""
        for n, t in named.items():
            if all(t is not u for u in self._named.values()):
                self._named[n] = t
        return {MODEL + n: self.owner[index[id(t)]] for n, t in named.items()}

    def owned_params(self, j: int) -> list[torch.Tensor]:
        return [p for p, o in zip(self.params, self.owner, strict=True) if o == j]

    def gatherer(self) -> ParamGather:
        """The parameters at rest from now on: this shard's kept, the others freed."""
        return ParamGather(
            self.params,  # type: ignore[arg-type]
            self.owner,
            self.mine,
            self._broadcast,
            unit_bytes=self.unit_bytes,
            launch=self._launch if self.prefetch else None,
        )

    def _broadcast(self, flat: torch.Tensor, src: int) -> None:
        dev, pg, t = self.group.device, self.group.pg, self.timeout
        buf = flat if flat.device == torch.device(dev) else flat.to(dev)
        self.group.call(lambda: pg.broadcast(buf, src).wait(t))
        if buf is not flat:
            flat.copy_(buf)

    def _launch(self, flat: torch.Tensor, src: int) -> Callable[[], None]:
        """The broadcast started on the group's comm thread; returns its wait (which
        leaves, raising, once the epoch changes: ``Comm.result``)."""
        dev, pg, t = self.group.device, self.group.pg, self.timeout
        buf = flat if flat.device == torch.device(dev) else flat.to(dev)
        fut = self.group.submit(lambda: pg.broadcast(buf, src).wait(t))

        def wait() -> None:
            self.group.result(fut)
            if buf is not flat:
                flat.copy_(buf)

        return wait

    # -- the step --------------------------------------------------------------------------

    def drop_foreign_grads(self) -> None:
        """Before the optimizer's step: only this shard's parameters are updated here."""
        for p, j in zip(self.params, self.owner, strict=True):
            if j != self.mine:
                p.grad = None

    def clip(self, params: Sequence[torch.Tensor], max_norm: float | None) -> float:
        """``clip_grad_norm_(params, max_norm, foreach=False)`` with each gradient correct
        on its range's owner only (a reduce-scatter): the same bits on this rank's own
        gradients. Each parameter's norm is taken by its owner, the vector of norms (one
        owner's value and zeros: an exact sum) is all-reduced over the group, and the total
        is torch's norm of that vector, as ``clip_grad_norm_`` stacks the norms (one
        device and dtype, which the float32 slot buffer's gradients are). Returns that
        total (the norm before clipping); ``max_norm`` None: the norm only, nothing scaled
        (one small all-reduce: the gradient norm is logged on every step)."""
        grads = [p.grad for p in params if p.grad is not None]
        owners_ = [self.grad_owner[id(p)] for p in params if p.grad is not None]
        dev = self.group.device
        norms = torch.zeros(len(grads), dtype=torch.float32, device=dev)
        for i, (g, j) in enumerate(zip(grads, owners_, strict=True)):
            if j == self.mine:
                norms[i] = torch.linalg.vector_norm(g, 2.0)
        pg, t = self.group.pg, self.timeout
        self.group.call(lambda: pg.allreduce([norms]).wait(t))
        if not grads:
            return 0.0
        # on the first gradient's device, as torch stacks them (a CUDA model's norms must
        # not be summed up on the CPU of a gloo group: another kernel, other bits)
        total = torch.linalg.vector_norm(norms.to(grads[0].device), 2.0)
        if max_norm is None:
            return float(total)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for g, j in zip(grads, owners_, strict=True):
                if j == self.mine:
                    g.mul_(coef.to(g.device))
        return float(total)

    def sync_params(self) -> None:
        """After it: each shard's owner broadcasts its updated parameters to the group (as
        bytes, so any dtype travels), and the others copy them in."""
        for j in range(self.k):
            owned = self.owned_params(j)
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
        # Finished, if it can be, when the epoch changes: a death in another group would
        # otherwise tear this group's replica (each rank then needs a whole replica's
        # state, and with every group torn the run restarts from a checkpoint).
        self.group.call(lambda: pg.broadcast(flat, j).wait(t), grace_s=SYNC_GRACE_S)
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
        tensor, in the same order), so no rank holds more than one foreign tensor at once.
        The model's tensors of each shard too, with the parameters sharded at rest."""
        shard_of_key = {**self._key_shards(whole), **self.model_keys}
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
        # What every shard holds whole (param groups, the scheduler, the reduction's carried
        # exponents) is this rank's own, never another shard's meta copy.
        whole = {key: value for key, value in state.items() if key != "state"}
        return {**merge(parts), **whole}

    def holders(self, state: dict[str, Any], world: int) -> dict[str, tuple[int, ...]]:
        """For each tensor of a shard's optimizer state (as a checkpoint names it), the
        ranks of a ``world``-member epoch that hold it: that shard's rank in every group."""
        ranks = [tuple(r for r in range(world) if shard_of(r, self.k) == j) for j in range(self.k)]
        keys = {**self._key_shards(state), **self.model_keys}
        return {key: ranks[j] for key, j in keys.items()}

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

    def exchange(
        self, epoch: Comm, held: int, state: dict[str, Any], fill: Fill = _as_is
    ) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
        """At an epoch's start, over the whole epoch: every member that lacks its shard's
        state copies it (``comm/swarm.py``) from every rank that holds it for real, or from
        the lowest rank that holds every shard virtually. ``held``: what this rank holds
        (a shard, ``ALL``, or ``NONE``); returns the optimizer state this rank must load
        (its shard only; None when it holds exactly that already) and, with the
        parameters sharded at rest, the shard's parameters it received (by state dict
        name; empty when it holds them). ``fill(params)``: the parameters of a shard this
        rank sends made resident around the send (``Trainer.filled``, for a replica
        that holds every shard only virtually)."""
        dev = epoch.device
        mine = torch.tensor([held], dtype=torch.int64, device=dev)
        outs = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(epoch.size)]
        epoch.call(lambda: epoch.pg.allgather([outs], [mine]).wait(self.timeout))
        holdings = [int(o[0]) for o in outs]
        got: dict[str, Any] | None = None
        params: dict[str, torch.Tensor] = {}
        for j, src in sorted(sources(holdings, self.k).items()):
            out = self._copy_shard(epoch, j, src, holdings, state, fill)
            if out is not None:
                params, got = out.model, out.optimizer
                self.received = (out.template, out.nbytes)
        if got is not None:
            return part(got, self.owner, self.mine), params
        if held == ALL:
            return part(state, self.owner, self.mine), {}
        return None, {}

    def _copy_shard(
        self,
        epoch: Comm,
        j: int,
        src: int,
        holdings: list[int],
        state: dict[str, Any],
        fill: Fill,
    ) -> Received | None:
        """Shard ``j`` to the ranks of its position that lack it, by the swarm copy
        (``comm/swarm.py``): from every rank that holds it for real, or from ``src``
        alone (a replica holding every shard virtually, made resident for the send)."""
        real = [r for r, h in enumerate(holdings) if h == j]
        givers = real or [src]
        receivers = tuple(
            r for r in range(epoch.size) if shard_of(r, self.k) == j and holdings[r] not in (j, ALL)
        )
        offer = None
        resident: list[torch.Tensor] = []
        if self.rank in givers:
            model = self._shard_model(j)
            extra = {"next_step": 0, "held": j, "data": {}, "decisions": []}
            offer = (model, part(state, self.owner, j), extra)
            resident = [self._named[n] for n in model]
        named = getattr(self, "_named", {})
        job = CopyJob(
            receivers=receivers,
            source=givers[0],
            shard_degree=1,
            layout={n: (tuple(t.shape), t.dtype) for n, t in named.items()},
            offer=offer,
            target=_shard_target(named, epoch.device) if self.rank in receivers else None,
            timeout=self.timeout,
        )
        with fill(resident) if offer is not None else contextlib.nullcontext():
            return SwarmCopy().copy(epoch, job)

    def _shard_model(self, j: int) -> dict[str, torch.Tensor]:
        """Shard ``j``'s parameters by state dict name (sharded at rest only; else none)."""
        if not self.shard_params:
            return {}
        return {n: t.detach() for n, t in self._named.items() if self.model_keys[MODEL + n] == j}


def _shard_target(
    named: dict[str, torch.Tensor], device: torch.device
) -> Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]:
    """A shard's receiver's storage: its own parameters (made resident), fresh optimizer
    tensors on the group's device."""

    def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key.startswith(MODEL):
            t = named[key[len(MODEL) :]]
            make_resident(t)
            return t.detach()
        return torch.empty(shape, dtype=dtype, device=device)

    return target
