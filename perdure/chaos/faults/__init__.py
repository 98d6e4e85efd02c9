"""The fault registry: the one map from a fault kind to what it is and does.

Every module of this package but ``base`` holds exactly one :class:`Fault` subclass; the
registry finds them at import, so a new kind is one new module (and its test), with no
list to edit anywhere. The config (``FaultConfig.kind``), its reference page, the launcher
side (``chaos/driver.py``), the worker side (``runtime/member/wchaos.py``), the fault report
(``chaos/summary.py``) and the HTML report all read this registry.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from perdure.chaos.faults.base import FailureClass, Fault
from perdure.chaos.faults.corrupt_part import CORRUPT_PART
from perdure.chaos.faults.poison_part import POISON_PART

_SKIP = frozenset({"base"})


def discover(package: ModuleType) -> dict[str, Fault]:
    """``{kind: instance}`` of the one Fault subclass in each module of ``package``,
    ordered by kind. A module with none or several, or two modules with the same kind,
    is a programming error and fails at import."""
    found: dict[str, Fault] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name in _SKIP or info.name.startswith("_"):
            continue
        fault = _one_fault(importlib.import_module(f"{package.__name__}.{info.name}"))
        if fault.kind in found:
            raise ImportError(f"fault kind {fault.kind!r} is defined twice ({info.name})")
        found[fault.kind] = fault
    return dict(sorted(found.items()))


def _one_fault(module: ModuleType) -> Fault:
    classes = [
        v
        for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, Fault) and v.__module__ == module.__name__
    ]
    if len(classes) != 1:
        raise ImportError(f"{module.__name__}: expected one Fault subclass, found {len(classes)}")
    return classes[0]()


def _registry() -> dict[str, Fault]:
    import sys

    return discover(sys.modules[__name__])


REGISTRY: dict[str, Fault] = _registry()
"""Every fault kind, by name, in name order."""

RENAMED: dict[str, str] = {"poison_shard": POISON_PART, "corrupt_shard": CORRUPT_PART}
"""Old kind names, still accepted with a DeprecationWarning: a dataset file is a *part*,
and *shard* means an optimizer or parameter shard only (docs/architecture.md, glossary)."""


def kinds() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(kind: str) -> Fault | None:
    return REGISTRY.get(kind)


def failure_class(kind: str) -> FailureClass | None:
    """The failure class of ``kind``; ``None`` for a kind this code does not know."""
    fault = REGISTRY.get(kind)
    return fault.failure_class if fault else None


def in_process_kinds() -> frozenset[str]:
    """Kinds the worker applies itself (it polls the store only for these)."""
    return frozenset(k for k, f in REGISTRY.items() if f.in_process)


__all__ = [
    "REGISTRY",
    "RENAMED",
    "FailureClass",
    "Fault",
    "discover",
    "failure_class",
    "get",
    "in_process_kinds",
    "kinds",
]
