"""The run's identity beyond its config file, and the check of a task's loss contract.

The config hash covers the config's math fields; the math also depends on what the config
only names: the dataset (by its version id: content, layout and build parameters) and the
task's recipe (optimizer and scheduler hyperparameters, the loss's reduction). The trainer
and the launcher's preflight compute the same identity and pass it to ``config_hash``.
"""

from __future__ import annotations

from typing import Any

import torch

from perdure.runtime.replica.task import Task, split_loss
from perdure.runtime.replica.user_rng import SlotRng

REL_TOL = 1e-3


def run_identity(task: Task, recipe: dict[str, Any], dataset_version: str) -> dict[str, Any]:
    """The canonical ``identity`` entry: dataset version, recipe, loss reduction."""
    return {"dataset": dataset_version, "recipe": recipe, "loss_reduction": task.loss_reduction}


def measured_reduction(task: Task, batch: dict[str, torch.Tensor]) -> str | None:
    """What ``task.loss_fn`` does over a batch's samples, measured: ``"sum"`` or ``"mean"``,
    or None when the batch cannot tell (one sample, a zero loss) or the loss is neither.

    The loss of the whole batch is compared with the losses of its samples one at a time,
    with the model in eval mode (no dropout; BatchNorm on its running statistics), so each
    sample's loss does not depend on the others. Nothing is changed: no gradient, no buffer
    update, and the model's mode is restored. The user's generators are seeded as in a
    slot (``user_rng``), so a loss that draws still runs (its draws differ between the
    whole batch and one sample, so it may not be told) and one that draws from a generator
    perdure cannot seed is refused here, before any worker starts.
    """
    n = int(batch["weight"].shape[0])
    if n < 2:
        return None
    model, was = task.model, task.model.training
    model.eval()
    rng = SlotRng(task.loss_fn, model)

    def loss(rows: dict[str, torch.Tensor]) -> float:
        with rng.slot(0, 0, 0), torch.no_grad():  # the user's generators as in a slot
            return float(split_loss(task.loss_fn(model, rows), tuple(task.metrics))[0])

    try:
        whole = loss(batch)
        parts = [loss(_rows(batch, i)) for i in range(n)]
    finally:
        model.train(was)
    total = sum(parts)
    if _close(whole, total) and not _close(whole, total / n):
        return "sum"
    if _close(whole, total / n) and not _close(whole, total):
        return "mean"
    return None


def check_loss_reduction(task: Task, batch: dict[str, torch.Tensor]) -> str | None:
    """Raise if the loss measurably is not what the task declares; returns a note when it
    cannot be told (a loss that is neither a sum nor a mean of per-sample losses, such as
    a mean over all tokens of the batch, still trains identically whoever computes which
    slot, but its scale depends on ``train.slot_size``)."""
    got = measured_reduction(task, batch)
    declared = task.loss_reduction
    if got is None:
        return (
            f"task.loss_reduction: could not confirm {declared!r} on the first slot's samples "
            "(the loss is neither a sum nor a mean of per-sample losses, or the slot holds "
            "one sample)"
        )
    if got != declared:
        raise ValueError(
            f"task.loss_reduction: the task declares {declared!r} but its loss_fn returns "
            f"the {got} of its samples' losses (measured on the first slot of step 0); "
            f"set Task(loss_reduction={got!r}) or change loss_fn"
        )
    return None


def _rows(batch: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    return {k: v[i : i + 1] for k, v in batch.items()}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b)) and max(abs(a), abs(b)) > 0
