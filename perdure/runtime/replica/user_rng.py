"""The user's randomness inside a slot: every generator a task can reach, seeded from
(seed, step, slot), and the ones perdure cannot seed caught.

What a ``loss_fn`` draws (dropout, augmentation, random crops, mixup, token masking) is
part of the math, so it must be a function of ``(seed, step, slot)`` only, like the samples
(``docs/architecture.md``, "The user's randomness"). Around each slot, :class:`SlotRng`:

- saves the global generators (torch's CPU one and every initialised CUDA one, numpy's
  global ``RandomState``, Python's ``random``), seeds each from the slot seed, and restores
  the saved states after the slot, so the code outside slots (and a checkpoint's ``rng``
  field) never depends on which slots a process happened to compute;
- hands the task a numpy ``Generator`` for the slot (:func:`slot_generator`, PCG64 seeded
  from the slot seed): ``np.random.default_rng`` as a user expects it, but reproducible;
- checks the generators it cannot seed: a ``numpy.random.Generator`` or ``RandomState``,
  a ``random.Random`` or a ``torch.Generator`` that the task holds (in ``loss_fn``'s
  closure, the module globals it names, its bound object, or an attribute of a submodule
  of the model). One whose state changed across a slot makes the slot raise
  :class:`UncontrolledRandomness` naming it: its draws would differ with the membership.

Limits, admitted: a generator created *inside* the slot from OS entropy
(``np.random.default_rng()`` with no seed, ``os.urandom``, ``secrets``) leaves no state to
compare and is not caught; nor is a generator reached only through a container (a list or a
dict held by the task) or through a function more than three calls deep.
"""

from __future__ import annotations

import contextlib
import functools
import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

_DEPTH = 3

_current: np.random.Generator | None = None


class UncontrolledRandomness(RuntimeError):
    """A generator perdure does not seed changed state during a slot."""


def slot_generator() -> np.random.Generator:
    """The running slot's numpy ``Generator`` (PCG64 seeded from (seed, step, slot)): use it
    in a ``loss_fn`` where ``np.random.default_rng()`` would be. Outside a slot (where a
    draw would not be reproducible) it raises."""
    if _current is None:
        raise RuntimeError(
            "perdure.slot_generator(): called outside a slot; it exists only while perdure "
            "runs a task's loss_fn"
        )
    return _current


def seed_globals(seed: int) -> None:
    """Seed every global generator from ``seed`` (torch, CUDA, numpy, Python's)."""
    seed_torch(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    random.seed(seed)


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, without its cost where no accelerator is available.

    On such a build ``torch.manual_seed`` seeds the CPU generator and queues a lazy seed for
    CUDA, XPU and MTIA each, to run if that device initialises, each with a formatted
    traceback of its caller: 0.2 ms a call from a slot's stack here (the goodput run's step
    0.063 -> 0.058 s without it). A device that is not available cannot initialise, so the
    CPU generator alone is what the call seeds; where an accelerator is available, the call
    is torch's own."""
    if _accelerated():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@functools.cache
def _accelerated() -> bool:
    """Whether any accelerator torch seeds is available (asked once: it does not change
    within a process, and asking initialises none)."""
    return torch.accelerator.is_available() or torch.backends.mps.is_available()


class SlotRng:
    """Seeds the user's generators around one slot and checks the ones it cannot seed."""

    def __init__(self, loss_fn: Callable[..., Any], model: nn.Module) -> None:
        self.watched = _reachable(loss_fn, model)
        """(where, generator): the user's own generators, found once."""

    @contextlib.contextmanager
    def slot(self, seed: int, step: int, slot: int) -> Iterator[None]:
        """Inside: every global generator seeded from ``seed`` (the slot's seed) and
        :func:`slot_generator` available; after: the global states as they were before,
        and an error if a generator perdure does not seed moved."""
        global _current
        saved = _save_globals()
        before = [_state(g) for _, g in self.watched]
        seed_globals(seed)
        _current = np.random.Generator(np.random.PCG64(seed))
        try:
            yield
        finally:
            _current = None
            _restore_globals(saved)
        for (where, gen), was in zip(self.watched, before, strict=True):
            if not _same(was, _state(gen)):
                raise UncontrolledRandomness(
                    f"task.loss_fn: {where} ({_kind(gen)}) changed state during slot {slot} of "
                    f"step {step}; perdure cannot seed a generator the task holds, so its draws "
                    "would depend on which worker ran which slot. Draw from "
                    "perdure.slot_generator() (numpy) or the global generators (torch, "
                    "numpy.random, random), which perdure seeds from (seed, step, slot)"
                )


def _save_globals() -> dict[str, Any]:
    out: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state_all()
    return out


def _restore_globals(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch_cpu"])
    np.random.set_state(saved["numpy"])
    random.setstate(saved["python"])
    if "torch_cuda" in saved:
        torch.cuda.set_rng_state_all(saved["torch_cuda"])


_GLOBAL = (np.random.mtrand._rand, random._inst, torch.default_generator)  # type: ignore[attr-defined]


def _is_generator(obj: object) -> bool:
    kinds = (np.random.Generator, np.random.RandomState, random.Random, torch.Generator)
    return isinstance(obj, kinds) and not any(obj is g for g in _GLOBAL)


def _reachable(loss_fn: Callable[..., Any], model: nn.Module) -> list[tuple[str, Any]]:
    """The user's own generators that ``loss_fn`` or ``model`` holds, each named by where
    it was found."""
    found: dict[int, tuple[str, Any]] = {}
    _scan_callable(loss_fn, "", found, _DEPTH, set())
    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if _is_generator(value):
                where = f"model.{name}.{attr}" if name else f"model.{attr}"
                found.setdefault(id(value), (f"generator {where!r}", value))
    return list(found.values())


def _scan_callable(
    fn: Any, path: str, found: dict[int, tuple[str, Any]], depth: int, seen: set[int]
) -> None:
    if depth == 0 or id(fn) in seen:
        return
    seen.add(id(fn))
    bound = getattr(fn, "__self__", None)
    if bound is not None and not isinstance(bound, types.ModuleType):
        _scan_object(bound, f"{path}self", found, depth, seen)
        fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        if callable(fn) and hasattr(fn, "__dict__") and not isinstance(fn, type):
            _scan_object(fn, path or type(fn).__name__, found, depth, seen)
            call = vars(type(fn)).get("__call__")
            if isinstance(call, types.FunctionType):
                _scan_function(call, path, found, depth, seen)
        return
    _scan_function(fn, path, found, depth, seen)


def _scan_function(
    fn: types.FunctionType, path: str, found: dict[int, tuple[str, Any]], depth: int, seen: set[int]
) -> None:
    names = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    values: list[tuple[str, Any]] = []
    for name, cell in names.items():
        with contextlib.suppress(ValueError):  # an empty cell
            values.append((f"closure variable {name!r} of {fn.__qualname__}", cell.cell_contents))
    module = fn.__globals__.get("__name__", "?")
    for name in _global_names(fn.__code__):
        if name in fn.__globals__:
            values.append((f"global {name!r} of module {module!r}", fn.__globals__[name]))
    for where, value in values:
        if _is_generator(value):
            found.setdefault(id(value), (where, value))
        elif isinstance(value, types.FunctionType | types.MethodType):
            _scan_callable(value, path, found, depth - 1, seen)


def _global_names(code: types.CodeType) -> set[str]:
    """Every name ``code`` (and the code of functions nested in it) may read globally."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _scan_object(
    obj: Any, path: str, found: dict[int, tuple[str, Any]], depth: int, seen: set[int]
) -> None:
    for attr, value in getattr(obj, "__dict__", {}).items():
        if _is_generator(value):
            found.setdefault(id(value), (f"attribute {path}.{attr}", value))


def _state(gen: Any) -> Any:
    if isinstance(gen, np.random.Generator):
        return gen.bit_generator.state
    if isinstance(gen, np.random.RandomState):
        return gen.get_state(legacy=False)
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    return gen.getstate()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return bool(a == b)


def _kind(gen: Any) -> str:
    """The generator's public type name (``torch.Generator``, not ``torch._C.Generator``)."""
    if isinstance(gen, torch.Generator):
        return "torch.Generator"
    if isinstance(gen, np.random.Generator | np.random.RandomState):
        return f"numpy.random.{type(gen).__name__}"
    return f"{type(gen).__module__}.{type(gen).__qualname__}"
