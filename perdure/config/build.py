"""Map plain data (parsed TOML) onto keyword-only config dataclasses, collecting problems.

Types are checked from the dataclass annotations, so a config class needs no schema of its
own: ``int`` (a bool is not an int), ``float`` (an int is accepted), ``str``, ``bool``,
``list[X]``, ``dict[str, X]``, ``X | None``, ``Literal[...]`` and nested config dataclasses.
Unknown keys, missing required keys and wrong types are all reported; only when the types
are right is the class built, so that ``__post_init__`` sees well-typed values and adds its
own range checks to the same report.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

from perdure.config.errors import ConfigError, Problem

T = TypeVar("T")


class RenamedWarning(DeprecationWarning):
    """An old name of a config value, a fault kind or a flag was used; the command line
    shows these (``perdure.cli``), unlike other DeprecationWarnings."""


_MISSING = dataclasses.MISSING


def build(cls: type[T], data: object, prefix: str = "") -> T:
    """Build ``cls`` from ``data``; raise one ConfigError listing every problem."""
    value, problems = _build_dataclass(cls, data, prefix)
    if problems:
        raise ConfigError(problems)
    assert value is not None
    return value


def renamed_value(value: object, renamed: Mapping[str, str], key: str) -> Any:
    """``value``, or its new name where it is an old one (``renamed``: old to new), with a
    DeprecationWarning naming the key and both names. A field lists its values' old names
    in its metadata (``renamed(...)``), so a config written before a rename still loads."""
    if not isinstance(value, str) or value not in renamed:
        return value
    new = renamed[value]
    warnings.warn(f"{key}: {value!r} is now called {new!r}; the old name will be refused in a "
                  "later release", RenamedWarning, stacklevel=3)  # fmt: skip
    return new


_HINTS: dict[type, dict[str, Any]] = {}


def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class (callers only read it).
    Evaluating a dataclass's string annotations is tens of microseconds a class: building a
    worker's config took 16 ms of a replacement's start-up, and the control channel paid
    35-75 us a decoded message. (Two threads may both evaluate a class once: the same
    result either way.)"""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def prepare(cls: type) -> None:
    """Evaluate the annotations of ``cls`` and of every dataclass its fields name, nested
    (:func:`type_hints`): what a process that forks workers does once, before it forks."""
    todo, seen = [cls], set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        todo += [d for tp in type_hints(c).values() for d in _dataclasses_in(tp)]


def _dataclasses_in(tp: Any) -> list[type]:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return [tp]
    return [d for arg in get_args(tp) for d in _dataclasses_in(arg)]


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build_dataclass(cls: type[T], data: object, prefix: str) -> tuple[T | None, list[Problem]]:
    if not isinstance(data, Mapping):
        return None, [Problem(prefix or "<root>", f"must be a table ({cls.__name__})", data)]
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    problems = [
        Problem(_key(prefix, k), f"unknown key; known keys: {sorted(fields)}", data[k])
        for k in data
        if k not in fields
    ]
    kwargs: dict[str, Any] = {}
    buildable = True
    for name, f in fields.items():
        has_default = f.default is not _MISSING or f.default_factory is not _MISSING
        if name not in data:
            if not has_default:
                problems.append(Problem(_key(prefix, name), "required key is missing", None))
                buildable = False
            continue
        raw = renamed_value(data[name], f.metadata.get("renamed", {}), _key(prefix, name))
        value, sub = _convert(hints[name], raw, _key(prefix, name))
        problems += sub
        if not sub:
            kwargs[name] = value
        elif not has_default:
            buildable = False
    if not buildable:
        return None, problems
    # Fields with a type problem fall back to their defaults here, so that the range checks
    # of __post_init__ still report on every other field in the same pass.
    try:
        value = cls(**kwargs)
    except ConfigError as e:
        bad = {p.key for p in problems}
        problems += [q for q in (p.under(prefix) for p in e.problems) if q.key not in bad]
        return None, problems
    return (None, problems) if problems else (value, [])


def _convert(tp: Any, value: object, key: str) -> tuple[Any, list[Problem]]:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build_dataclass(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(tp, value, key)
    if origin is Literal:
        allowed = get_args(tp)
        ok = value in allowed
        return value, [] if ok else [Problem(key, f"must be one of {list(allowed)}", value)]
    if origin is list:
        return _convert_list(get_args(tp)[0], value, key)
    if origin is dict:
        return _convert_dict(get_args(tp)[1], value, key)
    return _convert_scalar(tp, value, key)


def _convert_union(tp: Any, value: object, key: str) -> tuple[Any, list[Problem]]:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None, []
    first: list[Problem] = []
    for arg in args:
        if arg is type(None):
            continue
        out, problems = _convert(arg, value, key)
        if not problems:
            return out, []
        first = first or problems
    return None, first


def _convert_list(item: Any, value: object, key: str) -> tuple[Any, list[Problem]]:
    if not isinstance(value, list):
        return None, [Problem(key, "must be a list", value)]
    out, problems = [], []
    for i, v in enumerate(value):
        converted, sub = _convert(item, v, f"{key}[{i}]")
        out.append(converted)
        problems += sub
    return out, problems


def _convert_dict(item: Any, value: object, key: str) -> tuple[Any, list[Problem]]:
    if not isinstance(value, Mapping):
        return None, [Problem(key, "must be a table", value)]
    out, problems = {}, []
    for k, v in value.items():
        converted, sub = _convert(item, v, _key(key, str(k)))
        out[str(k)] = converted
        problems += sub
    return out, problems


_SCALAR_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _convert_scalar(tp: Any, value: object, key: str) -> tuple[Any, list[Problem]]:
    if tp is Any or tp is object:
        return value, []
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), []
    if tp in (int, float) and isinstance(value, bool):
        return None, [Problem(key, f"must be {_SCALAR_NAMES[tp]}", value)]
    if isinstance(value, tp):
        return value, []
    return None, [Problem(key, f"must be {_SCALAR_NAMES.get(tp, tp.__name__)}", value)]
