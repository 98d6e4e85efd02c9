"""The snapshot: a copy of the state's tensors into reused CPU buffers.

Buffers are kept between saves (keyed by tensor name, reallocated only when a shape or
dtype changes), so after the first save a snapshot touches no fresh pages: its cost is a
plain memory copy. Device tensors are copied into pinned buffers (device to host).
"""

from __future__ import annotations

import torch


class SnapshotBuffers:
    """Reusable CPU buffers, one per tensor name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer_for(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def keep_only(self, keys: set[str]) -> None:
        """Drop buffers of tensors the state no longer has."""
        for k in set(self._buffers) - keys:
            del self._buffers[k]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def copy_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair; waits for device-to-host copies to land."""
    cuda = False
    with torch.no_grad():
        for src, dst in pairs:
            nb = src.device.type == "cuda"
            cuda = cuda or nb
            dst.copy_(src.detach(), non_blocking=nb)
    if cuda:
        torch.cuda.synchronize()
