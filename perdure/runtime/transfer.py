"""Copy a live replica's state to joiners over the process group: replicate, resume, continue.

The source packs model tensors, optimizer tensors and a JSON header (optimizer structure,
data state, decision log, next step) into one byte buffer and broadcasts it; receivers
rebuild their state from it. Bytes, not typed tensors, so every dtype travels the same way
and nothing is pickled.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch

from perdure.runtime.comm import Comm

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _flat_tensors(
    model_state: dict[str, torch.Tensor], optim_state: dict[str, Any]
) -> list[tuple[str, torch.Tensor]]:
    out = [(f"model/{k}", v) for k, v in model_state.items()]
    for pid in sorted(optim_state["state"], key=int):
        for key, value in sorted(optim_state["state"][pid].items()):
            if isinstance(value, torch.Tensor):
                out.append((f"optim/{pid}/{key}", value))
    return out


def pack(
    model_state: dict[str, torch.Tensor], optim_state: dict[str, Any], extra: dict[str, Any]
) -> tuple[bytes, torch.Tensor]:
    """(header JSON, one uint8 buffer holding every tensor's bytes)."""
    tensors = _flat_tensors(model_state, optim_state)
    meta = [[name, list(t.shape), str(t.dtype)] for name, t in tensors]
    scalars = {
        str(pid): {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        for pid, st in optim_state["state"].items()
    }
    header = {
        "tensors": meta,
        "param_groups": optim_state["param_groups"],
        "scalars": scalars,
        "extra": extra,
    }
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in tensors]
    blob = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    return json.dumps(header).encode(), blob


def unpack(
    header: bytes, blob: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Inverse of :func:`pack`: (model state, optimizer state dict, extra)."""
    h = json.loads(header)
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, Any]] = {int(k): dict(v) for k, v in h["scalars"].items()}
    offset = 0
    for name, shape, dtype in h["tensors"]:
        dt = _DTYPES[dtype]
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dt).element_size()
        t = blob[offset : offset + n].clone().view(dt).reshape(shape)
        offset += n
        kind, _, rest = name.partition("/")
        if kind == "model":
            model[rest] = t
        else:
            pid, _, key = rest.partition("/")
            state.setdefault(int(pid), {})[key] = t
    return model, {"state": state, "param_groups": h["param_groups"]}, h["extra"]


def broadcast_state(
    comm: Comm, src: int, payload: tuple[bytes, torch.Tensor] | None, timeout: timedelta
) -> tuple[bytes, torch.Tensor]:
    """Broadcast (header, blob) from rank ``src``; every rank returns the source's copy."""
    sizes = torch.zeros(2, dtype=torch.int64)
    if payload is not None:
        sizes[0], sizes[1] = len(payload[0]), payload[1].numel()
    comm.call(lambda: comm.pg.broadcast([sizes], src).wait(timeout))
    if payload is None:
        head = torch.zeros(int(sizes[0]), dtype=torch.uint8)
        blob = torch.zeros(int(sizes[1]), dtype=torch.uint8)
    else:
        head = torch.frombuffer(bytearray(payload[0]), dtype=torch.uint8)
        blob = payload[1]
    comm.call(lambda: comm.pg.broadcast([head], src).wait(timeout))
    if blob.numel():
        comm.call(lambda: comm.pg.broadcast([blob], src).wait(timeout))
    return bytes(head.numpy().tobytes()), blob
