"""Where a replica's tensors live and which backend carries its collectives.

Read in one place from ``train.device`` (a math setting: kernels differ in their bits
between devices) and ``cluster.data_plane`` (not one: the reductions are perdure's own
arithmetic, exact integers or float adds in slot order, and give the same bits on either
side). Three placements:

- ``cpu``: model, slot buffers and collectives on the CPU, gloo;
- ``cuda`` with NCCL: model, slot buffers and collectives on this worker's GPU (one GPU
  per worker: NCCL refuses two ranks on one device);
- ``cuda`` with gloo: the model on the GPU, each slot's gradient copied into a slot buffer
  in host memory, collectives on the CPU: for workers that share a GPU.

Every checkpoint records the placement and the settings in force (``determinism``, in
its provenance field).

Limit, stated: the CUDA placements have not run on a GPU yet (no device was lent to the
sessions that built them); ``benchmarks/gpu_check.sh`` is the check to run on the first
one. On CPU, the tests cover everything around them and the refusal below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from perdure.runtime.config import ClusterConfig, TrainConfig

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's deterministic workspace setting (``CUBLAS_WORKSPACE_CONFIG``)."""


@dataclass(frozen=True)
class Placement:
    """The device of the model, the device of the slot buffers and collectives, and the
    data plane's backend."""

    device: torch.device
    buffers: torch.device
    backend: str

    @staticmethod
    def of(train: TrainConfig, cluster: ClusterConfig, local_index: int = 0) -> Placement:
        """``local_index``: this worker's index among the workers of its host (the GPU it
        takes, modulo the host's count)."""
        plane = cluster.data_plane
        if train.device == "cpu":
            if plane == "nccl":
                raise ValueError("cluster.data_plane: 'nccl' needs train.device = 'cuda'")
            cpu = torch.device("cpu")
            return Placement(cpu, cpu, "gloo")
        problem = cuda_problem()
        if problem is not None:
            raise ValueError(f"train.device: {problem}")
        gpu = torch.device("cuda", local_index % torch.cuda.device_count())
        if plane == "gloo":
            return Placement(gpu, torch.device("cpu"), "gloo")
        return Placement(gpu, gpu, "nccl")


def cuda_problem() -> str | None:
    """Why ``train.device = 'cuda'`` cannot run here, or None."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda or "none (a CPU build)"
    return (
        "'cuda' needs a CUDA device, and torch.cuda.is_available() is False on this host "
        f"(torch {torch.__version__}, CUDA build: {built})"
    )


def deterministic_cuda() -> None:
    """Set what changes a CUDA run's bits from one run to the next, before the first CUDA
    call (cuBLAS reads its workspace setting once): TF32 off (a math choice, not an
    accident of the card), deterministic cuDNN, no autotuning. What is in force is read
    back by ``determinism``, which every checkpoint records."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def determinism(placement: Placement) -> dict[str, Any]:
    """What this process runs with that can change the bits, read back from torch (not
    what was asked for): recorded in every checkpoint's provenance, so a resumed run that
    diverges can be told apart from one whose kernels or settings differ."""
    out: dict[str, Any] = {
        "device": str(placement.device),
        "buffers": str(placement.buffers),
        "data_plane": placement.backend,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "intra_op_threads": torch.get_num_threads(),
    }
    if placement.device.type == "cuda":
        out.update(
            device_name=torch.cuda.get_device_name(placement.device),
            capability=list(torch.cuda.get_device_capability(placement.device)),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
            cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
            cudnn_deterministic=torch.backends.cudnn.deterministic,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )
    return out
