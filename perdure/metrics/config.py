"""Config of the run's metric outputs; none of it changes the math."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from perdure.config import Checker


@dataclass(kw_only=True, frozen=True)
class MetricsConfig:
    """TensorBoard, Prometheus and W&B outputs of the coordinator (``perdure/metrics``)."""

    tensorboard: bool = True
    """Write TensorBoard event files under the run directory (``tensorboard_dir``): loss,
    learning rate, step time, tokens/s, membership changes, faults and failures. Needs
    the ``tensorboard`` package (``pip install perdure[metrics]``); without it the
    coordinator says so once in its log and writes none."""
    tensorboard_dir: str = "tb"
    """Directory of the event files, relative to the run directory (``tensorboard
    --logdir RUN_DIR/tb``)."""
    prometheus: bool = True
    """Serve the run's gauges and counters in Prometheus' text format over HTTP from each
    coordinator, on ``cluster.host`` only (never on every interface); the port is
    ``metrics_port`` in ``RUN_DIR/coordinator.json`` (``standby.json`` for the standby).
    Needs ``prometheus-client``; without it the coordinator says so once and serves
    none."""
    port: int = 0
    """Port of the Prometheus endpoint; 0 picks a free one. A fixed port that is taken
    (e.g. by the primary, for a standby on the same host) is retried every
    ``poll_ms`` until it is free."""
    wandb: bool = False
    """Log the run to Weights & Biases (``metrics/wandb_sink.py``): every step's
    ``train/*`` numbers and every evaluation's ``eval/*``, against ``step``, plus the
    run's config. Off by default; needs the ``wandb`` package (``pip install
    perdure[wandb]``). Written by the active coordinator from the logs, like TensorBoard."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` (the default): files under ``RUN_DIR/wandb/`` only, no account and no
    network (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later). ``online``:
    streamed to the W&B server, with the credentials of ``wandb login`` or
    ``WANDB_API_KEY``."""
    wandb_project: str = "perdure"
    """The W&B project the run is logged under (its name: the run directory's)."""
    poll_ms: int = 500
    """How often the coordinator reads new lines of the run's logs into both outputs: a
    point reaches TensorBoard and the endpoint at most this much after it is logged."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        c.check(
            bool(self.tensorboard_dir) and not self.tensorboard_dir.startswith("/"),
            "tensorboard_dir",
            "must be a relative path inside the run directory",
            self.tensorboard_dir,
        )
        c.check(".." not in self.tensorboard_dir.split("/"), "tensorboard_dir",
                "must not leave the run directory", self.tensorboard_dir)  # fmt: skip
        c.check(bool(self.wandb_project.strip()), "wandb_project", "must not be empty",
                self.wandb_project)  # fmt: skip
        c.check(10 <= self.poll_ms <= 60000, "poll_ms", "must be in [10, 60000]", self.poll_ms)
        c.done()


def missing_libraries(cfg: MetricsConfig) -> list[str]:
    """One line per output that is on but whose library is not installed (preflight's
    notes: the run still starts, without that output)."""
    wanted = [("tensorboard", cfg.tensorboard, "tensorboard", "metrics"),
              ("prometheus", cfg.prometheus, "prometheus_client", "metrics"),
              ("wandb", cfg.wandb, "wandb", "wandb")]  # fmt: skip
    return [
        f"metrics.{key}: {module} is not installed, so the run has none (pip install "
        f"perdure[{extra}], or set metrics.{key} = false)"
        for key, on, module, extra in wanted
        if on and importlib.util.find_spec(module) is None
    ]
