"""The one-buffer state copy (superseded by ``comm/swarm.py``), and the optimizer skeleton
codec a sharded save's layout uses (:func:`pack_skeleton`).

``pack`` / ``broadcast_state`` / ``unpack`` were how a joiner got its state until the swarm
copy: kept as the baseline ``benchmarks/bench_state_copy.py`` measures against (a second
copy of the whole state on the source, the whole buffer plus the cloned tensors on the
joiner), and ``broadcast_state`` carries the skeletons' headers.

The source flattens model and optimizer state with the checkpoint format's own codec
(tensors by name plus the optimizer's structure as tagged JSON, lossless: tuples stay
tuples, so a receiver's state digest equals the source's), packs every tensor's bytes into
one buffer and broadcasts it with a JSON header. Bytes, not typed tensors, so every dtype
travels the same way and nothing is pickled.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch

from perdure.checkpoint.tensors import flatten, model_of, unflatten_optimizer
from perdure.runtime.comm.group import Comm

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

State = tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]


def pack(
    model: dict[str, torch.Tensor],
    optim: dict[str, Any],
    extra: dict[str, Any],
    device: torch.device | None = None,
) -> tuple[bytes, torch.Tensor]:
    """(header JSON, one uint8 buffer holding every tensor's bytes in header order, on
    ``device``: the data plane's, default the CPU)."""
    device = device or torch.device("cpu")
    tensors, header = _header(model, optim, extra)
    parts = [
        t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors.values()
    ]
    blob = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    return json.dumps(header).encode(), blob


def _header(
    model: dict[str, torch.Tensor], optim: dict[str, Any], extra: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The flattened tensors and the JSON header naming them (key, shape, dtype)."""
    tensors, structure = flatten(model, optim)
    meta = [[k, list(t.shape), str(t.dtype)] for k, t in tensors.items()]
    return tensors, {"tensors": meta, "optimizer": structure, "extra": extra}


def unpack(header: bytes, blob: torch.Tensor) -> State:
    """Inverse of :func:`pack`: (model state, optimizer state dict, extra)."""
    h = json.loads(header)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for key, shape, dtype in h["tensors"]:
        dt = _DTYPES[dtype]
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        tensors[key] = blob[offset : offset + n].clone().view(dt).reshape(shape)
        offset += n
    assert offset == blob.numel(), (offset, blob.numel())
    return model_of(tensors), unflatten_optimizer(h["optimizer"], tensors), h["extra"]


def pack_skeleton(optim: dict[str, Any]) -> tuple[bytes, torch.Tensor]:
    """An optimizer state's structure, dtypes and shapes, without its bytes: what a replica
    group's other ranks need to name and lay out a shard they do not hold."""
    _, header = _header({}, optim, {})
    return json.dumps(header).encode(), torch.zeros(0, dtype=torch.uint8)


def unpack_skeleton(header: bytes) -> dict[str, Any]:
    """Inverse of :func:`pack_skeleton`: the optimizer state with ``meta`` tensors."""
    h = json.loads(header)
    tensors = {
        key: torch.empty(shape, dtype=_DTYPES[dtype], device="meta")
        for key, shape, dtype in h["tensors"]
    }
    return unflatten_optimizer(h["optimizer"], tensors)


def broadcast_state(
    comm: Comm, src: int, payload: tuple[bytes, torch.Tensor] | None, timeout: timedelta
) -> tuple[bytes, torch.Tensor]:
    """Broadcast (header, blob) from rank ``src``; every rank returns the source's copy."""
    dev = comm.device
    sizes = torch.zeros(2, dtype=torch.int64)
    if payload is not None:
        sizes[0], sizes[1] = len(payload[0]), payload[1].numel()
    sizes = sizes.to(dev)
    comm.call(lambda: comm.pg.broadcast(sizes, src).wait(timeout))
    n_head, n_blob = (int(x) for x in sizes.cpu())
    if payload is None:
        head = torch.zeros(n_head, dtype=torch.uint8, device=dev)
        blob = torch.zeros(n_blob, dtype=torch.uint8, device=dev)
    else:
        head = torch.frombuffer(bytearray(payload[0]), dtype=torch.uint8).to(dev)
        blob = payload[1]
    comm.call(lambda: comm.pg.broadcast(head, src).wait(timeout))
    if blob.numel():
        comm.call(lambda: comm.pg.broadcast(blob, src).wait(timeout))
    return bytes(head.cpu().numpy().tobytes()), blob
