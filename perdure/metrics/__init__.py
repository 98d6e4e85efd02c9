"""What a run shows while it runs: TensorBoard event files and a Prometheus endpoint.

Both are derived by the active coordinator from the run's own logs (``metrics.jsonl``,
``events.jsonl``), never from a worker's memory: the logs are the run's record, they
survive any worker, and a standby that takes over reads the same files. See
``service.py`` for why, ``view.py`` for what is read, ``tensorboard.py`` and
``prometheus.py`` for the two outputs.
"""

from perdure.metrics.config import MetricsConfig

__all__ = ["MetricsConfig"]
