"""Tensors as bytes: safetensors dtype names, byte views, and the flat list of a state.

The weights and the optimizer state become one ordered list of named, contiguous CPU
tensors (``model/<name>``, ``optimizer/<path>``); the optimizer's non-tensor structure
becomes tagged JSON (see :mod:`perdure.checkpoint.codec`) that points at those names.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from perdure.checkpoint import codec, layout

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {name: torch.empty(0, dtype=dt).element_size() for dt, name in DTYPES.items()}
assert ITEMSIZE == layout.DTYPE_SIZES, "the spec's dtype table and torch's must agree"

MODEL = "model/"
OPTIMIZER = "optimizer/"


def dtype_name(t: torch.Tensor, key: str) -> str:
    name = DTYPES.get(t.dtype)
    if name is None:
        raise TypeError(
            f"{key}: dtype {t.dtype} cannot be stored (supported: {sorted(DTYPES.values())})"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{key}: only dense tensors can be stored (got layout {t.layout})")
    return name


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (0-d and empty included).

    Through ctypes, not ``.numpy()``: a storage exported to numpy can never be resized
    again, and a parameter sharded at rest (``runtime/replica/param_gather.py``) is freed and
    gathered by resizing its storage. The view keeps the tensor alive."""
    assert t.is_contiguous() and t.device.type == "cpu"
    flat = t.reshape(-1)
    n = flat.numel() * flat.element_size()
    if n == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * n).from_address(flat.data_ptr())
    raw._tensor = flat  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


@dataclass(frozen=True)
class Meta:
    """Name, dtype and shape of one stored tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def row_bytes(self) -> int:
        """Bytes per index of the first dimension (0-d: the whole tensor)."""
        rows = self.shape[0] if self.shape else 1
        return self.nbytes // rows if rows else 0


def meta_of(key: str, t: torch.Tensor) -> Meta:
    return Meta(key, dtype_name(t, key), tuple(t.shape))


def flatten(
    model: dict[str, Any], optimizer: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], Any]:
    """``({key: tensor}, optimizer structure as tagged JSON)``, in a fixed order: model
    tensors in state-dict order, then optimizer tensors in walk order. Tensors are the
    caller's own (not copied, possibly on a device, possibly non-contiguous)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"model/{name}: model state must hold tensors (got {type(t).__name__})")
        key = MODEL + name
        dtype_name(t, key)
        tensors[key] = t

    def on_tensor(t: Any, path: str) -> str:
        key = OPTIMIZER + path.lstrip("/")
        if key in tensors:
            raise ValueError(f"{key}: two optimizer tensors map to the same name")
        dtype_name(t, key)
        tensors[key] = t
        return key

    structure = codec.encode(optimizer, on_tensor)
    return tensors, structure


def unflatten_optimizer(structure: Any, tensors: Mapping[str, Any]) -> Any:
    def on_tensor(name: str) -> Any:
        if name not in tensors:
            raise KeyError(f"optimizer structure names tensor {name!r}, which is not stored")
        return tensors[name]

    return codec.decode(structure, on_tensor)


def model_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(MODEL) :]: t for k, t in tensors.items() if k.startswith(MODEL)}


def to_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def plain_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each with its own storage (safetensors refuses shared
    storage, and a view would drag its base into a torch file)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
