"""The run in Weights & Biases: the coordinator's third output beside TensorBoard and
Prometheus, from the same logs (``service.py`` says why the logs and not rank 0).

What is logged: each committed step's ``train/loss``, ``train/lr`` (and ``train/lr/<group>``),
``train/grad_norm``, ``train/loss_scale`` (``fp16`` only),
``train/step_s`` and ``train/tokens_per_s``, and each evaluation's ``eval/<name>``
(``runtime/member/evaluate.py``), all against the metric ``step`` (the training step; W&B's own
``_step`` is only a count of log calls), plus the run's config (``config.json``'s content)
as the W&B config. A point is logged once: each tag keeps the last step logged and only a
later one is sent (``tensorboard.new_points``), so a step two members logged is one point.

Offline by default (``metrics.wandb_mode``): ``wandb.init(mode="offline")`` writes
``RUN_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb`` and needs no account and no
network; ``wandb sync`` uploads it later. The W&B run id is derived from the run
directory, so a resumed run in the same directory keeps its id. W&B's console capture,
system statistics and code saving are off: the coordinator's output stays its own.

Limits: only the active coordinator logs; a standby that takes over opens a W&B run of its
own (the same id; offline, a second ``offline-run-*`` directory) and logs what the logs
hold from its start, so points its predecessor had logged may appear twice after a sync.
W&B starts a helper process (``wandb-core``) that ``close`` ends with ``finish``; a
coordinator killed by SIGKILL leaves it to notice its parent's death by itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from perdure.metrics.tensorboard import Point, new_points

STEP = "step"
"""The x axis of every logged metric."""


def run_id(run_dir: Path) -> str:
    """A W&B run id (8 lowercase hex digits) that only the run directory decides."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]


def by_step(points: Iterable[Point]) -> list[dict[str, Any]]:
    """One W&B row per step, in step order: ``{"step": s, tag: value, ...}``. Pure."""
    rows: dict[int, dict[str, Any]] = {}
    for p in points:
        rows.setdefault(p.step, {STEP: p.step})[p.tag] = p.value
    return [rows[s] for s in sorted(rows)]


class WandbSink:
    """Logs new points to a W&B run under ``run_dir/wandb``."""

    def __init__(self, run_dir: Path, *, mode: str, project: str) -> None:
        import wandb  # ImportError: the caller turns the output off

        self._wandb = wandb
        self.run_dir = run_dir
        self.mode, self.project = mode, project
        self.last: dict[str, float] = {}
        self._run: Any = None
        self.logged = 0

    def write(self, points: Iterable[Point]) -> int:
        """Log the new ones among ``points``; how many were logged."""
        fresh = new_points(points, self.last)
        if not fresh:
            return 0
        run = self._open()
        for row in by_step(fresh):
            run.log(row)
        self.logged += len(fresh)
        return len(fresh)

    def _open(self) -> Any:
        if self._run is None:
            wandb = self._wandb
            settings = wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                x_disable_meta=True,
                save_code=False,
            )
            self._run = wandb.init(
                mode=self.mode,
                dir=str(self.run_dir),
                project=self.project,
                name=self.run_dir.name,
                id=run_id(self.run_dir),
                config=_config(self.run_dir),
                settings=settings,
                reinit="create_new",
            )
            self._run.define_metric(STEP)
            for prefix in ("train/*", "eval/*"):
                self._run.define_metric(prefix, step_metric=STEP)
        return self._run

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _config(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
