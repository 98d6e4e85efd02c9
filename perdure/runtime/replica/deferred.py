"""Models built without their parameters' bytes, then initialised a module at a time from
seeds of their own: the building blocks of sharded initialisation (issue 17).

Eager construction draws every parameter from the run seed's one stream, in construction
order, and a task's own code may initialise a parameter after it is registered (tiny_lm's
``normal_(std=0.02)`` in its parent's ``__init__``); so no rank can make one parameter's
bits without making every tensor before it. Here instead:

- :func:`build_deferred` runs a task's factory with every parameter replaced, as it is
  registered on a module, by a ``meta`` parameter of the same shape, dtype and
  ``requires_grad`` (a global parameter-registration hook): initialisation ops on them do
  nothing and draw nothing, buffers stay real, ties stay ties (one ``Parameter`` object);
  building a model holds one parameter's bytes at a time.
- :func:`materialize` gives each module's direct parameters their bytes in place
  (``torch.utils.swap_tensors``: the same objects, so ties, optimizers and hooks keep
  them) and initialises them under the CPU generator seeded from (seed, the module's
  qualified name): the task's ``init(name, module)`` where it takes the module, else the
  module's own ``reset_parameters``; a module with neither is refused by name. A tied
  parameter is the first holder's (in module order): a later holder initialises with a
  ``meta`` stand-in for it. A module
  that ``keep`` declines gets zero-byte storage instead (the at-rest form of
  ``param_gather.py``), and draws nothing. So a parameter's bits depend on the seed, its
  module's name and the init code only: any subset, in any order, on any rank, gives the
  same bits for the modules it keeps.

This is a different initialisation from the eager one (another function of the seed): to
the runtime it would be a math setting. Limits: not wired into the trainer yet (the
workers still build the whole model eagerly); a ``reset_parameters`` that writes a child's
parameters (``MultiheadAttention``'s ``out_proj.bias``) writes them only where the child is
already materialised, since the parent comes first in module order (the child's own
initialisation then decides); a buffer computed from a parameter at construction sees
none.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

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


def materialize(
    model: nn.Module,
    *,
    seed: int,
    init: Init | None = None,
    keep: Callable[[str, nn.Module], bool] = lambda _n, _m: True,
) -> list[str]:
    """Give every ``meta`` parameter of ``model`` its bytes, module by module in module
    order: initialised from the module's own seed where ``keep(name, module)``, zero-byte
    storage (at rest) elsewhere. Returns the names of the modules initialised."""
    done = []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.device.type == "meta"]
        if not params:
            continue
        if not keep(name, module):
            for p in params:
                _swap_in(p, resident=False)
            continue
        for p in params:
            _swap_in(p, resident=True)
        with _hidden_ties(module, {id(p) for p in params}):
            _init_module(name, module, seed, init)
        done.append(name)
    return done


@contextlib.contextmanager
def _hidden_ties(module: nn.Module, fresh: set[int]) -> Iterator[None]:
    """While ``module`` initialises, its direct parameters that an earlier module holds
    (ties) are ``meta`` stand-ins: a tied parameter is the first holder's, whichever
    modules this rank keeps (the stand-ins are set in ``_parameters`` directly, past the
    registration hooks)."""
    tied = {k: p for k, p in module._parameters.items() if p is not None and id(p) not in fresh}
    for k, p in tied.items():
        meta = torch.empty(p.shape, dtype=p.dtype, device="meta")
        module._parameters[k] = nn.Parameter(meta, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for k, p in tied.items():
            module._parameters[k] = p


def _swap_in(p: nn.Parameter, *, resident: bool) -> None:
    real = torch.empty(p.shape, dtype=p.dtype)
    if not resident:
        real.untyped_storage().resize_(0)
    torch.utils.swap_tensors(p, nn.Parameter(real, requires_grad=p.requires_grad))


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
