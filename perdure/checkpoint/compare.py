"""Comparing two loaded checkpoints field by field and tensor by tensor, bitwise."""

from __future__ import annotations

from typing import Any

import torch

from perdure.checkpoint.state import LoadedCheckpoint
from perdure.checkpoint.tensors import byte_view, flatten

_CONTEXT = (
    "step",
    "rng",
    "data",
    "config_hash",
    "canonical_config",
    "topology",
    "provenance",
    "decisions",
)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and byte_view(a.contiguous()) == byte_view(b.contiguous())
    )


def tensor_differences(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> list[str]:
    out = [f"only in A: {k}" for k in x if k not in y]
    out += [f"only in B: {k}" for k in y if k not in x]
    for k in x:
        if k in y and not same_bits(x[k], y[k]):
            how = "values"
            if x[k].dtype != y[k].dtype or x[k].shape != y[k].shape:
                how = f"{x[k].dtype} {list(x[k].shape)} vs {y[k].dtype} {list(y[k].shape)}"
            out.append(f"differs: {k} ({how})")
    return out


def compare(a: LoadedCheckpoint, b: LoadedCheckpoint) -> tuple[list[str], bool]:
    """Report lines and whether everything (seven fields, decision log) is equal."""
    lines: list[str] = []
    from perdure.checkpoint.codec import encode

    for name in _CONTEXT:
        va: Any = getattr(a, name)
        vb: Any = getattr(b, name)
        if encode(va) != encode(vb):
            lines.append(f"field {name}: differs")
    if a.config_hash != b.config_hash:
        from perdure.config.diff import diff_canonical

        keys = diff_canonical(a.canonical_config, b.canonical_config)
        lines.append(f"  config keys: {', '.join(keys) or '(none)'}")
    ta, sa = flatten(a.model, a.optimizer)
    tb, sb = flatten(b.model, b.optimizer)
    weights = tensor_differences(a.model, b.model)
    optim = tensor_differences(
        {k: v for k, v in ta.items() if k.startswith("optimizer/")},
        {k: v for k, v in tb.items() if k.startswith("optimizer/")},
    )
    if sa != sb:
        optim.append("differs: optimizer scalars or param groups")
    lines += [f"weights {w}" for w in weights] + [f"optimizer {o}" for o in optim]
    lines.append(f"weights bitwise equal: {'yes' if not weights else 'no'}")
    lines.append(f"optimizer state bitwise equal: {'yes' if not optim else 'no'}")
    return lines, len(lines) == 2
