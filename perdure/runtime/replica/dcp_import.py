"""A run that starts from a PyTorch DCP checkpoint: ``perdure ckpt import``.

A DCP checkpoint holds weights (and perhaps an optimizer state) but none of what makes a
perdure run reproducible (config hash, data position, decision log, RNG). So the import
makes a perdure checkpoint at step 0 of the given run: the run's own replica as its
config builds it (data at its start, an empty decision log, the config's hash), with the
DCP checkpoint's weights, and its optimizer state where it maps onto the run's optimizer
(the same parameter names in the same groups; ``checkpoint/dcp.py``). The run then
starts from it with ``perdure run CONFIG --resume OUT/step-000000000``, through the same
resume path as any checkpoint (sharded at rest, resharded to any layout, verified), and
its initial state is the DCP state bit for bit.

Limits: the task's scheduler and the exact reduction's carried exponents start fresh
(DCP holds neither); the replica is built whole in this one process (its parameters
are never sharded here, whatever ``train.shard_params`` says: the field is not part of
the math, so the checkpoint is the same).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from perdure.checkpoint import save_checkpoint
from perdure.checkpoint.dcp import DcpError, optimizer_by_index, param_names, read_dcp
from perdure.run_config import RunConfig
from perdure.runtime.replica.recipe import SCHEDULER_KEY
from perdure.runtime.replica.trainer import Trainer


def whole(config: RunConfig) -> RunConfig:
    """``config`` with every parameter held by this one process (no math changes)."""
    train = dataclasses.replace(config.train, shard_params=False, shard_degree=1)
    return dataclasses.replace(config, train=train)


def import_dcp(config: RunConfig, dcp_dir: str | Path, root: str | Path, *,
               optimizer: bool = True) -> Path:  # fmt: skip
    """Write the step-0 checkpoint of ``config``'s run holding the DCP checkpoint at
    ``dcp_dir`` (weights; and the optimizer state, with ``optimizer``, where the DCP
    checkpoint has one) under ``root``; return its path."""
    trainer = Trainer(whole(config))
    try:
        model, optim = read_dcp(dcp_dir, trainer.module.state_dict())
        trainer.module.load_state_dict(model, strict=True)
        if optimizer and optim is not None:
            names = param_names(trainer.module, trainer.recipe.optimizer)
            state = optimizer_by_index(optim, names, str(dcp_dir))
            if trainer.recipe.scheduler is not None:  # DCP holds none: the run's own start
                state[SCHEDULER_KEY] = trainer.recipe.scheduler.state_dict()
            try:
                trainer.recipe.load_state_dict(state, source=str(dcp_dir))
            except (KeyError, ValueError, TypeError) as e:
                raise DcpError(f"{dcp_dir}: the optimizer state does not fit the run's "
                               f"optimizer ({e})") from None  # fmt: skip
        return Path(save_checkpoint(root, trainer.checkpoint_state({})))
    finally:
        trainer.close()
