"""Tagged JSON: the context and the optimizer's non-tensor state, without pickle.

Plain JSON loses tuples, non-finite floats and non-string dict keys, all of which occur
in a torch optimizer's ``state_dict`` (``betas`` is a tuple, ``state`` is keyed by int).
A round trip must be exact, so such values are written as one-key tagged objects:

- ``{"$tuple": [...]}``            a tuple
- ``{"$float": "nan"|"inf"|"-inf"}`` a non-finite float
- ``{"$dict": [[key, value], ...]}`` a dict with a non-string key, or a key starting ``$``
- ``{"$tensor": "name"}``          a tensor stored in a safetensors file under ``name``

Everything else (None, bool, int, finite float, str, list, dict with plain string keys)
is ordinary JSON. Python's ``json`` writes floats with ``repr``, which round-trips exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from perdure.checkpoint.errors import CorruptCheckpointError

TAGS = ("$tuple", "$float", "$dict", "$tensor")


def encode(value: Any, on_tensor: Callable[[Any, str], str] | None = None, path: str = "") -> Any:
    """``value`` as tagged JSON. ``on_tensor(tensor, path)`` stores a tensor and returns its
    name; without it a tensor is an error naming its path."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, on_tensor, f"{path}/{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, on_tensor, f"{path}/{i}") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _encode_dict(value, on_tensor, path)
    if on_tensor is not None and _is_tensor(value):
        return {"$tensor": on_tensor(value, path)}
    raise TypeError(f"{path or '<root>'}: cannot store a {type(value).__name__} in a checkpoint")


def _encode_dict(value: dict, on_tensor: Callable[[Any, str], str] | None, path: str) -> Any:
    plain = all(isinstance(k, str) and not k.startswith("$") for k in value)
    if plain:
        return {k: encode(v, on_tensor, f"{path}/{k}") for k, v in value.items()}
    items = [
        [encode(k, None, f"{path}/<key>"), encode(v, on_tensor, f"{path}/{k}")]
        for k, v in value.items()
    ]
    return {"$dict": items}


def decode(value: Any, on_tensor: Callable[[str], Any] | None = None) -> Any:
    """Inverse of :func:`encode`; ``on_tensor(name)`` returns the tensor stored as ``name``
    (without it, ``{"$tensor": name}`` is left as it is)."""
    if isinstance(value, list):
        return [decode(v, on_tensor) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tuple":
            return tuple(decode(v, on_tensor) for v in inner)
        if tag == "$float":
            return float(inner)
        if tag == "$dict":
            return {_hashable(decode(k)): decode(v, on_tensor) for k, v in inner}
        if tag == "$tensor":
            return on_tensor(inner) if on_tensor is not None else value
    return {k: decode(v, on_tensor) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


class _StrictJSONError(ValueError):
    """JSON that Python's parser accepts but the format does not."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        dup = next(k for k in keys if keys.count(k) > 1)
        raise _StrictJSONError(f"key {dup!r} appears twice in one object")
    return out


def _no_constant(name: str) -> Any:
    raise _StrictJSONError(f"bare {name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _StrictJSONError(f"number {text[:40]} overflows a double")
    return value


def loads_strict(data: bytes, where: str, what: str = "") -> Any:
    """Parse ``data`` as UTF-8 JSON under the format's rules, or raise
    :class:`CorruptCheckpointError` naming ``where``: no other encoding, no repeated key
    in an object (Python would keep the last one silently, so a corrupt duplicate could
    replace a field), no ``NaN``/``Infinity`` literals, no float that overflows, no
    nesting deeper than the parser can follow. ``what`` names a part of the file."""
    isnot = f"{what} is not" if what else "not"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            where, f"{isnot} UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r})"
        ) from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(where, f"{isnot} valid JSON ({e})") from None
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(where, f"{isnot} valid JSON ({e})") from None
