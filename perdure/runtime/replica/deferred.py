"""Models built without their parameters' bytes, then initialised a module at a time from
seeds of their own: sharded initialisation (``task.init = "per_module"``).

Eager construction draws every parameter from the run seed's one stream, in construction
order, and a task's own code may initialise a parameter after it is registered (tiny_lm's
``normal_(std=0.02)`` in its parent's ``__init__``); so no rank can make one parameter's
bits without making every tensor before it. Here instead:

- :func:`build_deferred` runs a task's factory with every parameter replaced, as it is
  registered on a module, by a ``meta`` parameter of the same shape, dtype and
  ``requires_grad`` (a global parameter-registration hook): initialisation ops on them do
  nothing and draw nothing, buffers stay real, ties stay ties (one ``Parameter`` object);
  building a model holds one parameter's bytes at a time.
- :func:`at_rest` gives each parameter, in place (``torch.utils.swap_tensors``: the same
  objects, so ties, optimizers and hooks keep them), its device and a storage of zero
  bytes: the at-rest form of ``param_gather.py``.
- :class:`SeedInit` makes any subset resident with its initial bits. A parameter belongs
  to its first holder in module order (a tie to the module that registers it first); a
  holder's parameters are initialised together on the CPU, under the generator seeded
  from (seed, the holder's qualified name), by the task's ``init(name, module)`` where
  it takes the module, else the module's own ``reset_parameters``; a holder with neither
  is refused by name. While a holder initialises, its parameters are CPU stand-ins and
  every other parameter of its subtree (ties held earlier, its children's) a ``meta``
  one, so a write there is dropped: each parameter's bits depend on the seed, its
  holder's name and the init code only. Any subset, in any order, on any rank, on any
  device, gives the same bits.

This is another initialisation than the eager one (another function of the seed): to the
runtime a math setting. The trainer makes every parameter at once (unsharded), or with
``train.shard_params`` only its own shard once it knows it (``replica/pending.py``).
Limits: a module whose ``reset_parameters`` sets a child's parameters
(``MultiheadAttention`` zeroes ``out_proj.bias``) does not decide them: the child's own
initialisation does, unless the task's ``init`` takes the child (tiny_lm's does); a buffer
computed from a parameter at construction sees none; init code that reaches a parameter
other than through its module's attributes writes the parameter at rest (an error).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from perdure.runtime.replica.param_gather import free as free  # re-exported: the at-rest helpers
from perdure.runtime.replica.param_gather import make_resident as make_resident
from perdure.runtime.replica.param_gather import renew as renew
from perdure.runtime.replica.param_gather import resident as resident
from perdure.runtime.replica.param_gather import resident_bytes as resident_bytes

T = TypeVar("T")
Init = Callable[[str, nn.Module], bool]
"""A task's initialisation of one module's direct parameters (``name``: its qualified
name, ``""`` for the root); True when it took the module, False to leave it to the
module's ``reset_parameters``."""


def build_deferred(factory: Callable[[], T]) -> T:
    """``factory()`` with every parameter registered inside it on the ``meta`` device."""
    with _meta_parameters():
        return factory()


@contextlib.contextmanager
def _meta_parameters() -> Iterator[None]:
    def hook(_m: nn.Module, _name: str, p: nn.Parameter | None) -> nn.Parameter | None:
        if p is None or p.device.type == "meta":
            return None  # a tie (the same meta parameter again), or a removal
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        return nn.Parameter(meta, requires_grad=p.requires_grad)

    # the hook's return replaces the parameter (torch's stub types it as returning None)
    handle = register_module_parameter_registration_hook(hook)  # type: ignore[arg-type]
    try:
        yield
    finally:
        handle.remove()


def module_seed(seed: int, name: str) -> int:
    """The generator seed of one module: a pure function of the run seed and its name."""
    digest = hashlib.sha256(f"perdure/init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def at_rest(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Every ``meta`` parameter of ``model`` at rest on ``device``: the same shape, dtype and
    ``Parameter`` object (``swap_tensors``), over a storage of zero bytes (the form of
    ``param_gather.py``; nothing is allocated, not even for a moment)."""
    for p in model.parameters():
        if p.device.type == "meta":
            torch.utils.swap_tensors(p, nn.Parameter(_empty(p, device), p.requires_grad))


def _empty(p: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A contiguous tensor of ``p``'s shape and dtype whose storage holds zero bytes.
    (Allocated and freed at once: on the CPU its pages are never touched, on CUDA the
    caching allocator keeps the block for what comes next. ``set_`` onto an empty
    storage would resize the storage to fit.)"""
    out = torch.empty(p.shape, dtype=p.dtype, device=device)
    out.untyped_storage().resize_(0)
    return out


class SeedInit:
    """A model at rest (:func:`at_rest`) and what initialises any subset of its parameters:
    each parameter belongs to its first holder (in module order), and a holder's
    parameters are initialised together from its seed (as its ``reset_parameters`` or the
    task's ``init`` needs them)."""

    def __init__(self, model: nn.Module, *, seed: int, init: Init | None = None) -> None:
        self.seed, self.init = seed, init
        seen: set[int] = set()
        self.holders: list[tuple[str, nn.Module, list[nn.Parameter]]] = []
        """(name, module, the parameters it holds first), in module order."""
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            if own:
                self.holders.append((name, module, own))
        self.peak_bytes = 0
        """The most parameter bytes :meth:`fill` has held at once (its own and those it
        made resident), counted from the storages."""

    def fill(self, want: Sequence[torch.Tensor]) -> list[str]:
        """Give the parameters ``want`` (at rest) their initial bytes, in place; the other
        parameters of their holders are made for the initialisation and freed again.
        Returns the holders initialised, in module order."""
        ids = {id(p) for p in want}
        held = self._held()  # counted once: below, only this method makes bytes resident
        done = []
        for name, module, own in self.holders:
            if any(id(p) in ids for p in own):
                held = self._fill_holder(name, module, own, ids, held)
                done.append(name)
        return done

    def _fill_holder(
        self, name: str, module: nn.Module, own: list[nn.Parameter], ids: set[int], held: int
    ) -> int:
        """Initialise ``module``'s parameters on the CPU (the same bits on any device)
        into stand-ins, then copy the wanted ones into their parameters. Stand-ins are set
        in ``_parameters`` directly (past the registration hooks) over the module's whole
        subtree: a tie that an earlier module holds, and every descendant's parameter, is
        a ``meta`` stand-in, so what the module's code writes there is dropped (each
        parameter's holder alone decides it). ``held``: the parameter bytes resident
        before; returns those resident after."""
        mine = {id(p) for p in own}
        saved = {m: dict(m._parameters) for m in module.modules()}
        stand = {
            m: {
                k: _stand_in(p, m is module and id(p) in mine)
                for k, p in ps.items()
                if p is not None
            }
            for m, ps in saved.items()
        }
        for m, stood in stand.items():
            m._parameters.update(stood)
        try:
            _init_module(name, module, self.seed, self.init)
        finally:
            for m, kept in saved.items():
                m._parameters.update(kept)
        made = sum(_nbytes(t) for t in stand[module].values() if t.device.type != "meta")
        self.peak_bytes = max(self.peak_bytes, held + made)
        with torch.no_grad():
            for k, p in saved[module].items():
                if p is not None and id(p) in mine and id(p) in ids:
                    held += 0 if resident(p) else _nbytes(p)
                    make_resident(p)
                    p.copy_(stand[module][k])
        self.peak_bytes = max(self.peak_bytes, held)
        return held

    def _held(self) -> int:
        return resident_bytes(p for _, _, own in self.holders for p in own)


def _stand_in(p: nn.Parameter, real: bool) -> nn.Parameter:
    device = "cpu" if real else "meta"
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def materialize(
    model: nn.Module,
    *,
    seed: int,
    init: Init | None = None,
    keep: Callable[[str, nn.Module], bool] = lambda _n, _m: True,
) -> list[str]:
    """Every ``meta`` parameter of ``model`` on the CPU: initialised from its holder's own
    seed where ``keep(name, holder)``, at rest elsewhere. Returns the holders
    initialised."""
    at_rest(model)
    seeded = SeedInit(model, seed=seed, init=init)
    want = [p for n, m, own in seeded.holders if keep(n, m) for p in own]
    return seeded.fill(want)


def _init_module(name: str, module: nn.Module, seed: int, init: Init | None) -> None:
    gen = torch.default_generator
    state = gen.get_state()
    try:
        gen.manual_seed(module_seed(seed, name))
        with torch.no_grad():
            if init is not None and init(name, module):
                return
            reset = getattr(module, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"module {name or '(root)'!r} ({type(module).__name__}) has parameters of "
                    "its own and no reset_parameters(), and the task's init did not take it: "
                    "initialise it in the task's init"
                )
            reset()
    finally:
        gen.set_state(state)
