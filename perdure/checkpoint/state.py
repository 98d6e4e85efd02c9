"""The seven fields of a checkpoint as Python objects, and the digest that compares runs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint.tensors import MODEL, byte_view, flatten, meta_of, to_cpu_contiguous


@dataclass(kw_only=True)
class CheckpointState:
    """What a checkpoint holds: the seven fields of the design, written and loaded together.

    ``model`` and the tensors inside ``optimizer`` go to safetensors files; everything else
    is JSON (tuples, int keys and non-finite floats survive, see ``codec``). The context
    dicts must be JSON-able in that sense; anything else is an error naming its path.
    """

    step: int
    model: dict[str, torch.Tensor]
    """``model.state_dict()``: parameters and buffers."""
    optimizer: dict[str, Any]
    """``optimizer.state_dict()``: tensors in ``state``, scalars, ``param_groups``."""
    rng: dict[str, Any]
    """From :func:`perdure.checkpoint.capture_rng`."""
    data: dict[str, Any]
    """Data offset: dataset version id, epoch, step, sample cursor, quarantine set."""
    config_hash: str
    canonical_config: dict[str, Any]
    topology: dict[str, Any]
    """Regions, workers, membership epoch, slot plan at save time."""
    provenance: dict[str, Any]
    """Commit sha of the task's code and library versions (:mod:`perdure.provenance`)."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """The run's decision log up to this step."""


@dataclass(kw_only=True)
class LoadedCheckpoint(CheckpointState):
    """A checkpoint read back: the state plus where it came from."""

    path: Path
    manifest: dict[str, Any] = field(default_factory=dict)


def state_digest(
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    fetch: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> str:
    """One SHA-256 over weights and optimizer state: names, dtypes, shapes, exact bytes,
    and the optimizer's non-tensor structure (scalars, param groups).

    Stream hashed (spec, "State digest"): a JSON line describing everything, then the
    bytes of each tensor in sorted-name order. Equal digests mean bitwise-equal state.
    ``fetch(name, tensor)``, called for every tensor in that order, gives its bytes where
    this process holds only its layout (a ``meta`` tensor: a replica group's other shards),
    one tensor at a time, so the whole state is never held at once.
    """
    tensors, structure = flatten(model, optimizer)
    names = sorted(tensors)
    metas = [meta_of(k, tensors[k]) for k in names]
    head = {
        "format": "perdure-state-digest/1",
        "tensors": [[m.key, m.dtype, list(m.shape)] for m in metas],
        "optimizer": structure,
    }
    h = hashlib.sha256(json.dumps(head, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    for k in names:
        t = tensors[k] if fetch is None else fetch(k, tensors[k])
        h.update(byte_view(to_cpu_contiguous(t)))
    return "sha256:" + h.hexdigest()


def model_keys(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in tensors if k.startswith(MODEL)]
