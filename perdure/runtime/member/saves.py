"""A member's checkpoints: the epoch's writer, due and final saves, and what a failed save
costs (that checkpoint, never the run).

Every member writes the part of a checkpoint it holds (``Trainer.save_holders``); the
commit waits for every part, so a save is a collective of the epoch (``StoreExchange``),
and it is cut short with the epoch when the membership changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from perdure import events as ev
from perdure.checkpoint import AsyncCheckpointer, CheckpointSaveError, CheckpointState
from perdure.checkpoint.config import checkpoint_root
from perdure.checkpoint.tensors import flatten
from perdure.events import JsonLines
from perdure.run_config import RunConfig
from perdure.runtime.comm.exchange import StoreExchange
from perdure.runtime.control.fence import Fence
from perdure.runtime.member.epoch import Epoch
from perdure.runtime.replica.trainer import Trainer

FINAL_SAVE_ATTEMPTS = 2
"""The final save is tried again once when it fails: a failure on a full disk makes room
(``checkpoint.space``), and no later due step would retry it."""

log = logging.getLogger("perdure.worker")


def checkpointer(
    ep: Epoch,
    *,
    config: RunConfig,
    run_dir: Path,
    store: Callable[[float], dist.Store],
    should_stop: Callable[[], bool],
    fence: Fence,
    events: JsonLines,
    name: str,
) -> AsyncCheckpointer:
    """The epoch's background writer; rank 0 logs the saves, and a commit is refused once
    a newer coordinator fenced this one's generation."""
    ex = StoreExchange(store, ep.start.prefix, ep.rank, ep.size, should_stop)
    return AsyncCheckpointer(
        checkpoint_root(config.checkpoint, run_dir),
        config.checkpoint,
        rank=ep.rank,
        world=ep.size,
        exchange=ex,
        log=(lambda record: events.write({**record, "worker": name})) if ep.rank == 0 else None,
        before_commit=lambda: fence.check(ep.generation, "checkpoint commit"),
    )


def due(config: RunConfig, next_step: int, last_step: int) -> bool:
    """A periodic save is due after the update that makes ``next_step`` (the last step's
    is the final save's)."""
    every = config.checkpoint.every_steps
    return bool(every) and next_step % every == 0 and next_step < last_step


def check_saves(ckpt: AsyncCheckpointer, name: str) -> bool:
    """A failed background save (disk full, storage gone) costs that checkpoint, not the
    run: the previous ones are intact (a save commits by its last rename), its partial
    files are gone, retention made room if the disk was full, the failure is in the event
    log (once per episode) and training goes on; the next due save retries. True when a
    save had failed."""
    try:
        ckpt.check()
    except CheckpointSaveError as e:
        log.error("%s: %s; training goes on, the last good checkpoint is kept", name, e)
        return True
    return False


def topology(config: RunConfig, ep: Epoch) -> dict[str, Any]:
    """The checkpoint's cluster topology field: who held the run when it was written."""
    return {
        "regions": [r.name for r in config.cluster.regions],
        "workers": list(ep.plan.members),
        "membership_epoch": ep.number,
        "generation": ep.generation,
        "plan": ep.plan.to_dict(),
        "shard_degree": config.train.shard_degree,
    }


def save(trainer: Trainer, ep: Epoch, state: CheckpointState) -> None:
    """Start saving ``state``, each rank writing what it holds (``save_holders``), none
    of it on a rank whose state is partial (a paced copy's receiver: its share goes to
    the others, :func:`holders`)."""
    assert ep.ckpt is not None
    ep.ckpt.save(state, holders=holders(trainer, ep, state))


def holders(trainer: Trainer, ep: Epoch, state: CheckpointState) -> dict[str, tuple[int, ...]]:
    """Who writes each tensor that not every rank writes: ``Trainer.save_holders``, less
    the partial ranks (``StepRunner.partial``), which then write no tensor at all; their
    state's JSON fields are every member's (step, data offsets, decision log move with
    every update)."""
    held = trainer.save_holders(state, ep.size)
    partial = ep.runner.partial
    if not partial:
        return held
    whole = tuple(r for r in range(ep.size) if r not in partial)
    keys, _ = flatten(state.model, state.optimizer)
    return {k: tuple(r for r in held.get(k, whole) if r not in partial) for k in keys}


def save_due(trainer: Trainer, ep: Epoch, config: RunConfig, name: str) -> None:
    """The periodic save after an update; a previous save that failed meanwhile is
    logged, and training goes on."""
    try:
        save(trainer, ep, trainer.checkpoint_state(topology(config, ep)))
    except CheckpointSaveError as e:
        log.error("%s: %s; training goes on, the last good one is kept", name, e)


def save_final(trainer: Trainer, ep: Epoch, state: CheckpointState, name: str) -> None:
    """The final checkpoint, waited for, and tried once more when it fails."""
    assert ep.ckpt is not None
    ep.ckpt.wait_for_save()
    check_saves(ep.ckpt, name)
    for _attempt in range(FINAL_SAVE_ATTEMPTS):
        save(trainer, ep, state)
        ep.ckpt.wait_for_save()
        if not check_saves(ep.ckpt, name):
            return  # else a failure made room (a full disk) or was logged: try once more


def close_writer(ckpt: AsyncCheckpointer, events: JsonLines, name: str) -> None:
    """The epoch's writer at the epoch's end: a save in flight finishes or is abandoned
    (cut short by the membership change; logged, the last good checkpoint stays)."""
    try:
        ckpt.wait()
        ckpt.check()
    except Exception as e:
        events.write({"event": ev.CHECKPOINT_ABANDONED, "worker": name, "error": str(e)[:200]})
    ckpt.close()
