"""Parameters sharded at rest inside a replica group, gathered a unit at a time while a
slot runs: the memory half of HSDP (``train.shard_degree`` > 1, ``train.shard_params``).

At rest a rank holds only the parameters its shard owns (whole parameters, so the
optimizer's arithmetic is the unsharded one; the runtime gives each gather unit whole to
one shard: ``shard_plan.unit_owners``). Every other parameter
keeps its ``nn.Parameter`` object, shape and dtype, but its storage is resized to zero
bytes (what FSDP1 does with its flat parameters): the optimizer, the gradient hooks and
the slot engine keep the same tensors, and no module is rewritten.

While a slot runs (``active``):

- **forward**: the model is cut into *units* (``units``: the largest modules of at most
  ``unit_bytes`` of parameters, as FSDP wraps blocks); a unit's forward pre-hook gathers
  its parameters that are not resident, one broadcast per owner (the owner's parameters
  of the unit laid end to end, which a receiver's parameters then view: ``set_``, no
  copy; the runtime gives each unit one owner). A ``TorchFunctionMode`` sees every torch function's
  arguments and gathers, alone, a parameter used outside its unit's forward (a head tied
  to the embedding through ``.T``). Each module's forward hook frees the parameters of
  its subtree once its forward is done (a module whose parameters its parent passes to a
  functional call, as ``MultiheadAttention`` does with ``out_proj``, is covered by the
  parent's hook; a tied parameter used again elsewhere is simply gathered again);
- **backward**: ``saved_tensors_hooks`` save a parameter (or a view of one) as a marker
  instead of the tensor, so the freed storage is not kept alive by the graph; unpacking a
  marker of a parameter at rest gathers it with every parameter of its unit that the
  graph still holds markers of (one broadcast per owner again), and the parameter's
  post-accumulate hook frees it once its gradient is final (autograd sums every use of a
  leaf before that).

Gathering is a collective of the group, so every rank of a group must make the same
gathers in the same order. Every rank runs the same state machine for every parameter
(resident or not), including those it owns, for which "gather" means "send" and "free"
means nothing: the sequence is a pure function of the model's code and the batch shapes,
the same on every rank that runs a slot of the same shapes.

The bits are unchanged: a gathered parameter is the owner's bytes, and every op computes
on them exactly as on a whole replica.

The runtime uses it with ``train.shard_params`` (``shard_group.Shards.gatherer``, built
once a member holds its shard at an epoch's start; ``Trainer.compute_slots`` runs each
slot inside ``active``; the step runner keeps every rank of a group at the same number of
slots).

**Prefetch** (FSDP2's explicit prefetch; given a ``launch``, ``train.shard_prefetch``):
a unit's forward pre-hook, once its own parameters are in, starts the next unit's
broadcasts (the next in the cut's order, the order a forward visits them), and a gather
in the backward starts the previous unit's (its parameters the graph still holds markers
of), so one unit's bytes are on the wire while the other computes. The group's comm
thread runs them in the order they were launched, the same on every rank (a launch is a
pure function of the same state machine); a parameter in flight is waited for, never
gathered twice, where it is next needed (its unit's hook, a torch function, a free), and
every flight is landed before the slot ends. At most two units are held beyond the
shard; a prefetch the backward turns out not to need is only freed with the rest at the
slot's end.

Limits (this step): an owner sends a multi-parameter unit from a copy laid
end to end (its parameters are not views of one flat storage); a model whose
set of used parameters depends on the data (a router that skips experts) breaks the
lockstep; double backward (``create_graph``) is not supported, since unpacked parameters
are detached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

Broadcast = Callable[[torch.Tensor, int], None]
"""``broadcast(flat_uint8, src)``: the group's broadcast, in place, from rank ``src`` of
the group (the owner's shard index: a group's rank ``j`` owns shard ``j``)."""

Launch = Callable[[torch.Tensor, int], Callable[[], None]]
"""``launch(flat_uint8, src)``: start the same broadcast on the group's comm thread and
return its wait (which raises as ``broadcast`` would); the buffer must stay untouched
until the wait returns."""


@dataclass(frozen=True, eq=False)  # each flight is itself: hashed by identity
class _Flight:
    """One broadcast of some parameters of one owner, started and not yet landed."""

    owner: int
    idx: list[int]
    wait: Callable[[], None]
    flat: torch.Tensor | None
    """A unit's buffer (the owner's copy, or where a receiver's bytes land); None where
    the one parameter's own storage is the buffer."""
    temp: int
    """Bytes of the buffer beyond the parameters' own."""


def _done() -> None:
    return None


class ParamGather:
    """One rank's parameters of a replica group: which are resident, and the gathers."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        owner: Sequence[int],
        mine: int,
        broadcast: Broadcast,
        *,
        unit_bytes: int | None = None,
        launch: Launch | None = None,
    ) -> None:
        """``launch``: the broadcast started on the group's comm thread; given, the next
        unit is prefetched while one computes (see the module's doc)."""
        assert len(params) == len(owner), (len(params), len(owner))
        self.params = list(params)
        self.owner = list(owner)
        self.mine = mine
        self.broadcast = broadcast
        self.launch = launch
        self.flying: dict[int, _Flight] = {}
        """Parameters whose broadcast is on the wire (a prefetch), by index."""
        self.prefetched = 0
        """Broadcasts started ahead of their use."""
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.nbytes = [p.numel() * p.element_size() for p in self.params]
        for p in self.params:
            if not p.is_contiguous():
                raise ValueError("parameters sharded at rest must be contiguous")
        self.live = [True] * len(self.params)
        """The group-wide state machine: whether parameter i is resident on every rank
        (the owner's own copy is always there; this says whether it was sent)."""
        self.held = sum(self.nbytes)
        default = unit_budget(self.nbytes, k_of(owner))
        self.unit_bytes = default if unit_bytes is None else unit_bytes
        """The most parameter bytes a unit gathers at once (default ``unit_budget``; 0:
        each module's own parameters)."""
        self.busy = False
        self.gathers = 0
        """Broadcasts made (a unit's owner counts once)."""
        self.pending = [0] * len(self.params)
        """Markers of each parameter the autograd graph holds and has not unpacked."""
        self.unit_of: list[list[int]] = [[i] for i in range(len(self.params))]
        self.unit_pos = [-1] * len(self.params)
        """The position in the cut of each parameter's unit (-1: none)."""
        self._cut: list[tuple[nn.Module, list[int]]] | None = None
        """The model's units, cut once (the first ``active``): a pure function of its
        structure."""
        self.own = [p.untyped_storage() for p in self.params]
        """Each parameter's own storage (at rest: 0 bytes), kept while it views a unit's
        receive buffer."""
        self.release()
        self.peak_bytes = self.held
        """The most parameter bytes this rank has held at once."""

    # -- what this rank holds --------------------------------------------------------------

    def foreign(self, i: int) -> bool:
        return self.owner[i] != self.mine

    def release(self) -> None:
        """Back to rest: every flight landed (or, failed, dropped) and every foreign
        parameter's storage freed."""
        for f in list(dict.fromkeys(self.flying.values())):
            with contextlib.suppress(BaseException):  # the slot is over, or failing already
                self._land(f)
        self.flying.clear()
        for i in range(len(self.params)):
            self.free(i)

    # -- the two moves -----------------------------------------------------------------------

    def gather(self, i: int) -> None:
        """Make parameter i resident on every rank of the group (a collective)."""
        self.gather_many([i])

    def gather_many(self, indices: Sequence[int]) -> None:
        """Make parameters resident on every rank of the group: those in flight landed,
        then one broadcast per owner of those still at rest (in the order of the owners;
        the same on every rank, since ``live`` is)."""
        self._land_any(indices)
        for f in self._start_many(indices, self._now):
            self._land(f)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start the broadcasts of those of ``indices`` at rest, without waiting (no-op
        without a ``launch``)."""
        if self.launch is None:
            return
        for f in self._start_many(indices, self.launch):
            self.prefetched += 1
            for i in f.idx:
                self.flying[i] = f

    def _start_many(self, indices: Sequence[int], launch: Launch) -> list[_Flight]:
        todo = [i for i in dict.fromkeys(indices) if not self.live[i] and i not in self.flying]
        return [
            self._start(j, [i for i in todo if self.owner[i] == j], launch)
            for j in sorted({self.owner[i] for i in todo})
        ]

    def _now(self, flat: torch.Tensor, src: int) -> Callable[[], None]:
        self.broadcast(flat, src)
        return _done

    def _start(self, j: int, idx: list[int], launch: Launch) -> _Flight:
        """Put owner j's parameters ``idx`` on the wire: in place where there is one
        (into, or from, its own storage), else laid out in one buffer (``_layout``)."""
        ps = [self.params[i] for i in idx]
        with self._own_calls():
            if len(ps) == 1:
                if j != self.mine:
                    make_resident(ps[0])
                try:
                    wait = launch(_bytes(ps[0]), j)
                except BaseException:  # a failed collective: nothing half-received stays
                    if j != self.mine:
                        self._orphan(idx[0])
                    raise
                f = _Flight(j, idx, wait, None, 0)
            else:
                offsets, n = _layout(ps)
                flat = torch.empty(n, dtype=torch.uint8, device=ps[0].device)
                if j == self.mine:
                    for p, a in zip(ps, offsets, strict=True):
                        flat[a : a + p.numel() * p.element_size()].copy_(_bytes(p))
                wait = launch(flat, j)  # a failure leaves every parameter as it was
                mine = 0 if j == self.mine else sum(p.numel() * p.element_size() for p in ps)
                f = _Flight(j, idx, wait, flat, n - mine)
        if j != self.mine:
            self.held += sum(self.nbytes[i] for i in idx)
        self.peak_bytes = max(self.peak_bytes, self.held + self._temp() + f.temp)
        return f

    def _temp(self) -> int:
        return sum(f.temp for f in dict.fromkeys(self.flying.values()))

    def _land_any(self, indices: Sequence[int]) -> None:
        for f in dict.fromkeys(self.flying[i] for i in indices if i in self.flying):
            self._land(f)

    def _land(self, f: _Flight) -> None:
        """Wait for a broadcast; a receiver's parameters then view its buffer (``set_``,
        no copy). A failure leaves them at rest."""
        for i in f.idx:
            self.flying.pop(i, None)
        receiver = f.owner != self.mine
        try:
            with self._own_calls():
                f.wait()
        except BaseException:
            if receiver:
                self.held -= sum(self.nbytes[i] for i in f.idx)
                if f.flat is None:  # the parameter's own storage is on the wire
                    self._orphan(f.idx[0])
            raise
        if receiver and f.flat is not None:
            offsets, _ = _layout([self.params[i] for i in f.idx])
            storage = f.flat.untyped_storage()
            with self._own_calls(), torch.no_grad():
                for i, a in zip(f.idx, offsets, strict=True):
                    p = self.params[i]
                    p.set_(storage, a // p.element_size(), p.shape, p.stride())
        for i in f.idx:
            self.live[i] = True
        self.gathers += 1

    def free(self, i: int) -> None:
        """Drop parameter i (its storage, where this rank does not own it)."""
        if i in self.flying:
            self._land(self.flying[i])
        if not self.live[i]:
            return
        self.live[i] = False
        if self.foreign(i):
            with self._own_calls():
                self._to_own_storage(i)
            self.held -= self.nbytes[i]

    def _orphan(self, i: int) -> None:
        """Parameter i at rest again, its storage left to a broadcast that may still write
        into it (:func:`orphan`)."""
        orphan(self.params[i])
        self.own[i] = self.params[i].untyped_storage()

    def _to_own_storage(self, i: int) -> None:
        """Free parameter i's bytes: its own storage resized to 0, or, where it views a
        unit's receive buffer, its own storage put back first (``set_`` needs a storage
        that fits, so it is sized for the moment: allocated, never written)."""
        p, own = self.params[i], self.own[i]
        if p.untyped_storage().data_ptr() != own.data_ptr():  # a view of a unit's buffer
            own.resize_(self.nbytes[i])
            with torch.no_grad():
                p.set_(own, 0, p.shape, p.stride())
        own.resize_(0)

    @contextlib.contextmanager
    def _own_calls(self) -> Iterator[None]:
        """The torch calls of a gather or a free pass through the mode too (hooks run
        inside it): they must not gather. Without this, a free's ``untyped_storage()``
        re-entered ``touch`` on the ranks that do not own the parameter only, and the
        group's broadcasts no longer matched."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    # -- a slot's forward and backward -------------------------------------------------------

    @contextlib.contextmanager
    def active(self, model: nn.Module) -> Iterator[None]:
        """Run a slot's forward and backward inside: parameters are gathered when used and
        freed after. On exit every foreign parameter is freed again."""
        handles = self._unit_hooks(model) + self._module_hooks(model) + self._grad_hooks()
        try:
            with _Touch(self), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            for h in handles:
                h.remove()
            self.pending = [0] * len(self.params)
            self.release()

    def _unit_hooks(self, model: nn.Module) -> list[Any]:
        if self._cut is None:
            self._cut = units(model, self.index, self.nbytes, self.unit_bytes)
            for pos in reversed(range(len(self._cut))):  # a parameter's unit: the first
                for i in self._cut[pos][1]:
                    self.unit_of[i], self.unit_pos[i] = self._cut[pos][1], pos
        return [
            m.register_forward_pre_hook(self._gatherer(pos)) for pos, (m, _) in enumerate(self._cut)
        ]

    def _gatherer(self, pos: int) -> Callable[..., None]:
        assert self._cut is not None
        cut = self._cut

        def hook(*_: Any) -> None:
            self.gather_many(cut[pos][1])
            if pos + 1 < len(cut):
                self.prefetch(cut[pos + 1][1])

        return hook

    def _module_hooks(self, model: nn.Module) -> list[Any]:
        handles = []
        for m in model.modules():
            mine = [self.index[id(p)] for p in m.parameters() if id(p) in self.index]
            if mine:
                handles.append(m.register_forward_hook(self._freer(mine)))
        return handles

    def _freer(self, indices: list[int]) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            for i in indices:
                self.free(i)

        return hook

    def _grad_hooks(self) -> list[Any]:
        def hook_for(i: int) -> Callable[[torch.Tensor], None]:
            return lambda _p: self.free(i)

        return [
            p.register_post_accumulate_grad_hook(hook_for(i))
            for i, p in enumerate(self.params)
            if p.requires_grad
        ]

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        i = self.index.get(id(base))
        if i is None:
            return t
        self.pending[i] += 1
        offset = int(t.storage_offset() - base.storage_offset())  # where the view starts
        return _Saved(i, tuple(t.shape), tuple(t.stride()), offset)

    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _Saved):
            return x
        i = x.param
        if not self.live[i]:  # with the rest of its unit that the backward still needs
            self.gather_many([i, *(u for u in self.unit_of[i] if self.pending[u] > 0)])
            self._prefetch_before(self.unit_pos[i])
        self.pending[i] = max(0, self.pending[i] - 1)
        p = self.params[i]  # now possibly a view of another unit buffer: its own offset
        return p.detach().as_strided(x.shape, x.stride, p.storage_offset() + x.offset)

    @property
    def largest_unit(self) -> int:
        """The parameter bytes of the largest gather unit (0 before the first slot): with
        prefetch a rank holds at most its shard and two units' foreign bytes at once."""
        return max((sum(self.nbytes[i] for i in idx) for _, idx in self._cut or []), default=0)

    def _prefetch_before(self, pos: int) -> None:
        """In the backward: the unit before ``pos`` (the one a backward reaches next), its
        parameters the graph still holds markers of."""
        if self._cut is None or pos <= 0:
            return
        self.prefetch([u for u in self._cut[pos - 1][1] if self.pending[u] > 0])

    def touch(self, func: Any, args: Any, kwargs: Any) -> None:
        if self.busy or func in _METADATA:  # see ``_own_calls``, ``_METADATA``
            return
        for a in _tensors(args, kwargs):
            i = self.index.get(id(a))
            if i is not None:
                self.gather(i)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
"""Modules that are never called: a unit is one of their children, never them."""


def units(
    model: nn.Module, index: dict[int, int], nbytes: Sequence[int], budget: int
) -> list[tuple[nn.Module, list[int]]]:
    """The model cut into gather units: each module whose parameters (of ``index``, by
    ``id``) total at most ``budget`` bytes, largest first from the root; a module over
    the budget is a unit of its own parameters (not its children's), and its children are
    cut in turn. A pure function of the model's structure, the same on every rank."""
    out: list[tuple[nn.Module, list[int]]] = []

    def indices(m: nn.Module, recurse: bool) -> list[int]:
        found = (index.get(id(p)) for p in m.parameters(recurse=recurse))
        return list(dict.fromkeys(i for i in found if i is not None))

    def visit(m: nn.Module) -> None:
        idx = indices(m, True)
        if not idx:
            return
        if sum(nbytes[i] for i in idx) <= budget and not isinstance(m, _CONTAINERS):
            out.append((m, idx))
            return
        own = indices(m, False)
        if own and not isinstance(m, _CONTAINERS):
            out.append((m, own))
        for child in m.children():
            visit(child)

    visit(model)
    return out


def unit_budget(nbytes: Sequence[int], k: int) -> int:
    """The default unit size: a quarter of one shard's share of the parameter bytes (one
    layer of a 10-layer model at k = 2; what a rank holds in flight beyond its shard)."""
    return sum(nbytes) // (4 * k)


def k_of(owner: Sequence[int]) -> int:
    """The shard count an ownership list implies (at least 1)."""
    return max(owner, default=0) + 1


class _Saved(NamedTuple):
    """A saved parameter (or a view of one), as the graph keeps it: a marker. ``offset``
    is the view's, in elements from the parameter's own start."""

    param: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _metadata() -> frozenset[Any]:
    """The torch functions that read a tensor's metadata, never its bytes: a parameter at
    rest passed to one is not gathered. Without this, the slot engine's ``p.grad = None``
    before each slot (the ``grad`` setter is a torch function too) gathered every
    parameter at the slot's start, and the whole model was resident at once."""
    t = torch.Tensor
    props = ["grad", "shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "layout"]
    props += ["grad_fn", "is_cuda", "is_meta", "_base", "is_sparse", "is_quantized"]
    methods = ["numel", "nelement", "size", "dim", "stride", "storage_offset", "element_size"]
    methods += ["is_contiguous", "is_floating_point", "is_complex", "get_device", "untyped_storage"]
    methods += ["register_hook", "register_post_accumulate_grad_hook", "requires_grad_"]
    out: set[Any] = set()
    for name in props:
        d = getattr(t, name)
        out |= {d.__get__} | ({d.__set__} if hasattr(d, "__set__") else set())
    return frozenset(out | {getattr(t, name) for name in methods})


_METADATA = _metadata()


class _Touch(TorchFunctionMode):
    """Gathers a parameter the first time a torch function receives it."""

    def __init__(self, owner: ParamGather) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        self.owner.touch(func, args, kwargs)
        return func(*args, **kwargs)


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list | tuple):
            yield from (x for x in a if isinstance(x, torch.Tensor))


_ALIGN = 64
"""Bytes each parameter's offset in a unit's buffer is a multiple of (any dtype's)."""


def _layout(ps: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Each parameter's byte offset in a unit's buffer, and the buffer's size."""
    offsets, n = [], 0
    for p in ps:
        offsets.append(n)
        n += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
    return offsets, n


def _bytes(p: torch.Tensor) -> torch.Tensor:
    return p.detach().reshape(-1).view(torch.uint8)


# -- the at-rest form: a tensor whose storage has zero bytes ----------------------------


def resident(t: torch.Tensor) -> bool:
    """Whether a tensor has its bytes (one at rest has a storage of zero bytes)."""
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


def make_resident(p: torch.Tensor) -> None:
    """Give a tensor at rest a storage of its size again (contents undefined)."""
    need = int((p.storage_offset() + p.numel()) * p.element_size())
    if p.untyped_storage().nbytes() < need:
        p.untyped_storage().resize_(need)


def resident_bytes(params: Iterable[torch.Tensor]) -> int:
    """The bytes of those of ``params`` that are resident."""
    return sum(p.numel() * p.element_size() for p in params if resident(p))


def free(p: torch.Tensor) -> None:
    """Back to rest: a storage of zero bytes (the same storage: a view of the parameter
    that the autograd graph saved sees it gathered again)."""
    p.untyped_storage().resize_(0)


def renew(p: torch.Tensor) -> None:
    """``p`` on a fresh storage of its size (contents undefined), the old one left to
    whoever holds it: a receive that failed or was abandoned into ``p``'s storage may still
    land its bytes (gloo writes a receive whenever its bytes arrive, and the operation
    keeps its tensors until it ends), so the old memory stays valid, and out of ``p``,
    until that operation drops it."""
    fresh = torch.UntypedStorage(p.numel() * p.element_size(), device=p.device)
    with torch.no_grad():  # set_ needs a storage that fits
        p.set_(fresh, 0, p.shape, p.stride())


def orphan(p: torch.Tensor) -> None:
    """Back to rest on a fresh storage of zero bytes, the old one left to whoever holds it
    (:func:`renew`). Freed with :func:`free` instead, gloo wrote into freed memory: a
    survivor's glibc abort ("corrupted double-linked list") 40 ms after it abandoned a step
    with a prefetched gather on the wire, seen in a clean-clone CI."""
    renew(p)  # allocated, never written
    p.untyped_storage().resize_(0)
