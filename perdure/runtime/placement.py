"""Where a replica's tensors live and which backend carries its collectives.

Read in one place from ``train.device`` (a math setting: kernels differ in their bits
between devices). Today only ``cpu`` with gloo exists; CUDA with NCCL plugs in here
(the device of the model, the slot buffers and the reduction's scratch, and the
backend of each epoch's process group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perdure.runtime.config import TrainConfig


@dataclass(frozen=True)
class Placement:
    """The device of a replica's tensors and the data plane's backend."""

    device: torch.device
    backend: str

    @staticmethod
    def of(train: TrainConfig) -> Placement:
        backends = {"cpu": "gloo"}
        if train.device not in backends:
            raise ValueError(f"train.device: unsupported device {train.device!r}")
        return Placement(torch.device(train.device), backends[train.device])
