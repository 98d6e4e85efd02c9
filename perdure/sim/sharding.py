"""Sharded replicas: what one GPU of a replica group holds, and what its slot costs.

A *worker* of the simulator is a replica group of ``tp x pp x shard`` GPUs
(``deployment.gpus_per_worker``): tensor parallel inside a node, pipeline stages, and an
FSDP/HSDP shard group (ZeRO-3: parameters, gradients and optimizer state split ``shard``
ways, each shard GPU on its own data). Replicas are data parallel to each other; the
gradient reduction across replicas moves each GPU's ``P / (tp pp shard)`` values, every
GPU on its own NIC at once.

**Memory per GPU** (:func:`memory`), the documented rule:

- model states: ``P / (tp pp shard)`` x (``weight_bytes`` + ``grad_bytes`` +
  ``optimizer_bytes``): bf16 weights, fp32 gradients, fp32 master weights and Adam's two
  moments by default (2 + 4 + 12 = 18 bytes a parameter);
- perdure's reduction buffer: the streamed reduction's integer accumulator beside the
  float slot buffer, ``int_bytes`` per gradient value;
- activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", eq. 1 without the attention-score term, which flash attention
  does not keep): ``34 h`` bytes per token and layer without recomputation, ``2 h`` (the
  layer's input) with full recomputation, divided by ``tp``; a GPU holds its stage's
  ``layers / pp`` layers for ``min(pp, m)`` micro-batches in flight (1F1B; ``m``
  micro-batches a replica's step), of ``tokens_per_step / slots / shard`` tokens each.

**Step time by dimension** (:func:`slot_comm_s`; the pipeline bubble is in
:class:`~perdure.sim.steptime.ComputeModel`): tensor parallel's 4 all-reduces a layer (2
forward, 2 backward) of the micro-batch's activations over NVLink, not hidden; FSDP's
all-gather of the parameters (forward and backward) and reduce-scatter of the gradients
inside the replica, hidden by prefetch as far as the slot's compute goes.

Limits: no sequence or context parallelism, no expert parallelism; pipeline sends
between stages are not counted (a micro-batch's activations, small beside the rest);
recomputation's extra forward is not added to the compute; the optimizer's temporary
buffers and the framework's own memory are not counted (a margin the operator keeps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perdure.sim.config import DeploymentConfig, WorkloadConfig

GB = 1e9
ACT_BYTES_PER_TOKEN_LAYER = 34
"""Activation bytes a token keeps per layer, per unit of hidden size (bf16, no
recomputation): Korthikanti et al. 2022, eq. 1, the 5 a s / h attention term dropped."""
ACT_BYTES_RECOMPUTE = 2
"""With full recomputation only the layer's input (bf16) is kept."""
TP_ALLREDUCES_PER_LAYER = 4
"""Megatron tensor parallel: 2 all-reduces in the forward, 2 in the backward."""
FSDP_PASSES = 3
"""FSDP per micro-batch: all-gather for the forward, again for the backward,
reduce-scatter of the gradients."""


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    reduction: float
    """perdure's integer accumulator (0 for DDP)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.reduction

    def describe(self) -> str:
        parts = ("weights", "gradients", "optimizer", "activations", "reduction")
        inner = ", ".join(f"{p} {getattr(self, p) / GB:.1f}" for p in parts if getattr(self, p))
        return f"{self.total / GB:.1f} GB ({inner})"


def shards(w: WorkloadConfig) -> int:
    """GPUs a replica's model states are split over."""
    return w.tp * w.pp * w.shard


def microbatches(w: WorkloadConfig, d: DeploymentConfig) -> float:
    """Micro-batches (slots) a replica computes in a step at full strength."""
    return w.slots / d.workers


def memory(w: WorkloadConfig, d: DeploymentConfig, *, perdure: bool, int_bytes: int) -> Memory:
    """Bytes one GPU of a replica holds (the module docstring's rule)."""
    per = w.params / shards(w)
    mb_tokens = w.tokens_per_step / w.slots / w.shard
    act = ACT_BYTES_RECOMPUTE if w.recompute else ACT_BYTES_PER_TOKEN_LAYER
    in_flight = min(w.pp, max(1.0, microbatches(w, d)))
    activations = w.layers / w.pp * in_flight * mb_tokens * w.hidden * act / w.tp
    return Memory(
        weights=per * w.weight_bytes,
        gradients=per * w.grad_bytes,
        optimizer=per * w.optimizer_bytes,
        activations=activations,
        reduction=per * int_bytes if perdure else 0.0,
    )


def ring_bytes_s(nbytes: float, n: int, bps: float) -> float:
    """A ring all-reduce's bandwidth term over ``n`` GPUs."""
    return 2 * (n - 1) / n * nbytes / bps if n > 1 else 0.0


def slot_comm_s(w: WorkloadConfig, d: DeploymentConfig, flops_slot_s: float) -> float:
    """The exposed communication inside a replica for one slot on one stage."""
    nvlink = d.nvlink_gbps * GB / 8
    intra = d.intra_region_gbps * GB / 8
    mb_tokens = w.tokens_per_step / w.slots / w.shard
    act_bytes = mb_tokens * w.hidden * w.weight_bytes
    tp = w.layers / w.pp * TP_ALLREDUCES_PER_LAYER * ring_bytes_s(act_bytes, w.tp, nvlink)
    fsdp = 0.0
    if w.shard > 1:
        gathered = w.params / (w.tp * w.pp) * w.weight_bytes
        fsdp = FSDP_PASSES * (w.shard - 1) / w.shard * gathered / intra
    return tp + max(0.0, fsdp - flops_slot_s)


def memory_line(w: WorkloadConfig, d: DeploymentConfig, int_bytes: int) -> str:
    """perdure's and DDP's memory per GPU against the device's, for the output."""
    mine = memory(w, d, perdure=True, int_bytes=int_bytes).describe()
    ddp = memory(w, d, perdure=False, int_bytes=int_bytes).total / GB
    return f"perdure {mine}; DDP {ddp:.1f} GB; device {d.gpu_memory_gb:g} GB"
