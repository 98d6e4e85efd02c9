"""The snapshot: a copy of the state's tensors into reused CPU buffers.

Buffers are kept between saves (keyed by tensor name, reallocated only when a shape or
dtype changes), so after the first save a snapshot touches no fresh pages: its cost is a
plain memory copy. Device tensors are copied into pinned buffers (device to host) on a side
stream per device, so that the copy does not queue behind (or hold up) the next step's
kernels on the compute stream; the copying thread waits for those copies only.

Limit, stated: the CUDA path has not run on a GPU yet (``benchmarks/gpu_check.sh`` times
the snapshot's blocking time and checks the saved bytes through a resume).
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
    """``dst.copy_(src)`` for every pair; returns once every copy has landed."""
    on_device = [(src, dst) for src, dst in pairs if src.device.type == "cuda"]
    with torch.no_grad():
        for src, dst in pairs:
            if src.device.type != "cuda":
                dst.copy_(src.detach())
        if on_device:
            _copy_from_devices(on_device)


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_from_devices(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Device-to-host copies on each device's side stream, ordered after the work already
    queued on its current stream (the update being saved); waits on their events, not on
    the whole device."""
    events = []
    for dev in sorted({src.device for src, _ in pairs}, key=str):
        stream = _STREAMS.get(dev)
        if stream is None:
            stream = _STREAMS[dev] = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                if src.device == dev:
                    dst.copy_(src.detach(), non_blocking=True)
        events.append(stream.record_event())
    for e in events:
        e.synchronize()
