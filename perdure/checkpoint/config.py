"""Config of periodic checkpoints; none of it changes the math."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from perdure.config import Checker


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """When checkpoints are taken, what is kept, and how saves overlap training."""

    dir: str | None = None
    """Where the checkpoints are written; default ``RUN_DIR/checkpoints``. A relative path
    is under the run directory. Put them on another file system than the run's logs and
    control files when that one is small or slow: a full checkpoint disk then costs
    saves only (which are retried, see ``docs/deployment.md``, "Storage")."""
    every_steps: int = 50
    """Save every this many steps (0 disables periodic saves; the final one is always
    written)."""
    keep_last: int = 3
    """Keep the newest this many checkpoints."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    on_busy: Literal["wait", "skip"] = "wait"
    """When a save is due while the previous one is still being written: ``wait`` for it
    (the step loop blocks) or ``skip`` this save (logged)."""
    verify_on_load: bool = True
    """Verify every file's checksum when loading. A rank that loads whole checks the
    files it reads; with ``train.shard_params`` a rank reads only its shard's byte ranges,
    so the launcher's preflight checks every file of a ``--resume`` checkpoint once
    (streamed), and the coordinator every checkpoint it picks after a loss."""
    snapshot_overlap: bool = True
    """Let the snapshot copy run on a background thread after ``save()`` returns, so it
    overlaps the next forward and backward; the step loop calls ``wait_snapshot()`` before
    anything writes the state: the update, or the step's first slot where computing the
    slots writes it (DiLoCo's inner steps move the parameters, BatchNorm's forward its
    running statistics): for those the copy overlaps only the commit. Off: the copy
    completes inside ``save()``."""

    def __post_init__(self) -> None:
        c = Checker()
        c.non_negative("every_steps", self.every_steps)
        c.positive("keep_last", self.keep_last)
        c.non_negative("keep_every", self.keep_every)
        c.check(self.dir is None or bool(self.dir.strip()), "dir", "must not be empty",
                self.dir)  # fmt: skip
        c.done()


def checkpoint_root(config: CheckpointConfig, run_dir: str | Path) -> Path:
    """The directory a run's checkpoints go to (``dir``, relative to ``run_dir``)."""
    if config.dir is None:
        return Path(run_dir) / "checkpoints"
    return Path(run_dir) / config.dir  # an absolute ``dir`` replaces ``run_dir``
