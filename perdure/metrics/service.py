"""The coordinator's metric outputs: one thread that reads the run's logs into TensorBoard
event files, the Prometheus endpoint's snapshot and (``metrics.wandb``) a W&B run.

Why the coordinator, from the logs, and not the rank-0 worker from its memory: rank 0 is
whoever is first in the running epoch's chain, so it changes with every membership change,
and a rank 0 that dies takes its unflushed points with it while the next one does not know
where it stopped (points lost or drawn twice). The logs do not have that problem:
``metrics.jsonl`` has a line per committed step, whoever wrote it, and ``events.jsonl``
holds every epoch, fault and failure. The active coordinator (off the hot path, one per
run) turns new lines into points every ``metrics.poll_ms``; a standby that takes over reads
back what its predecessor wrote and goes on after it (``tensorboard.py``), and the
points its predecessor had not flushed are still in the logs. The Prometheus endpoint is
served by every coordinator (the same numbers: they read the same files), with
``perdure_coordinator_active`` telling which one is in charge; only the active one writes
event files.

Nothing here can stop the coordinator: the outputs run on their own threads, a missing
library or a failing write is reported once in the coordinator's log and that output is
left off, and :meth:`MetricsService.close` gives up on a stuck thread after a timeout.
Limit: a standby started long after the run (by hand, on another machine) sees the logs
from its own start only; so does the endpoint of any coordinator.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perdure.metrics.config import MetricsConfig
from perdure.metrics.view import RunView, Snapshot

if TYPE_CHECKING:
    from perdure.metrics.prometheus import MetricsServer
    from perdure.metrics.tensorboard import TensorBoardSink
    from perdure.metrics.wandb_sink import WandbSink

log = logging.getLogger("perdure.metrics")

CLOSE_S = 10.0
"""How long ``close`` waits for the metrics thread's last pass."""


class MetricsService:
    """Started by the coordinator; ``port`` is the Prometheus endpoint's (None: off, or
    not bound yet)."""

    def __init__(
        self,
        cfg: MetricsConfig,
        *,
        run_dir: str | Path,
        host: str,
        steps: int,
        standby: bool = False,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.cfg, self.host, self.standby, self.active = cfg, host, standby, active
        self.run_dir = Path(run_dir)
        self.view = RunView(self.run_dir)
        self.latest = Snapshot()
        self.role = "standby" if standby else "coordinator"
        self._steps = steps
        self._server: MetricsServer | None = None
        self._sink: TensorBoardSink | None = None
        self._wandb: WandbSink | None = None
        self._tb_off = not cfg.tensorboard
        self._wandb_off = not cfg.wandb
        self._prom_off = not cfg.prometheus
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._bind()  # now, so that the ports file can name the port
        self._thread = threading.Thread(target=self._loop, daemon=True, name="metrics")
        self._thread.start()

    @property
    def port(self) -> int | None:
        server = self._server
        return None if server is None else server.port

    def close(self) -> None:
        """A last pass (the run's final steps reach TensorBoard), then stop both outputs."""
        self._stop.set()
        self._thread.join(timeout=CLOSE_S)
        if self._thread.is_alive():
            log.warning("the metrics thread did not stop within %g s", CLOSE_S)
            return
        self._poll()
        with self._lock:
            parts: list[Any] = [self._sink, self._server, self._wandb]
            for part in parts:
                if part is not None:
                    self._guard("close", part.close)
            self._sink = self._server = self._wandb = None

    # -- the thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.poll_ms / 1000):
            self._poll()
            if self._server is None and not self._prom_off:
                self._bind()

    def _poll(self) -> None:
        with self._lock:
            new_metrics, _ = self.view.update()
            self.latest = self.view.snapshot()
            if not self._tb_off and self.active():
                self._guard("tensorboard", lambda: self._write_tb(new_metrics))
            if not self._wandb_off and self.active():
                self._guard("wandb", lambda: self._write_wandb(new_metrics))

    def _write_tb(self, new_metrics: list[dict[str, Any]]) -> None:
        from perdure.metrics import tensorboard as tb

        if self._sink is None:
            try:
                self._sink = tb.TensorBoardSink(
                    self.run_dir / self.cfg.tensorboard_dir, takeover=self.standby
                )
            except ImportError as e:
                self._tb_off = True
                log.warning("metrics.tensorboard: %s; no event files (pip install "
                            "perdure[metrics], or set metrics.tensorboard = false)", e)  # fmt: skip
                return
            new_metrics = self.view.metrics  # all of this launch, once (the keys dedupe)
        evals = tb.eval_points(self.view.evals)  # all: the keys keep each point once
        self._sink.write([*tb.train_points(new_metrics), *evals, *tb.event_points(self.view)])

    def _write_wandb(self, new_metrics: list[dict[str, Any]]) -> None:
        from perdure.metrics import tensorboard as tb

        if self._wandb is None:
            from perdure.metrics.wandb_sink import WandbSink

            try:
                self._wandb = WandbSink(
                    self.run_dir, mode=self.cfg.wandb_mode, project=self.cfg.wandb_project
                )
            except ImportError as e:
                self._wandb_off = True
                log.warning("metrics.wandb: %s; no W&B run (pip install perdure[wandb], or "
                            "set metrics.wandb = false)", e)  # fmt: skip
                return
            new_metrics = self.view.metrics  # all of this launch, once (the keys dedupe)
        evals = tb.eval_points(self.view.evals)  # all: the keys keep each point once
        self._wandb.write([*tb.train_points(new_metrics), *evals])

    def _bind(self) -> None:
        if self._prom_off:
            return
        try:
            from perdure.metrics.prometheus import MetricsServer, RunCollector

            collector = RunCollector(
                lambda: self.latest,
                self.active,
                self.role,
                self._steps,
                run=str(self.run_dir.resolve()),
            )
            self._server = MetricsServer(self.host, self.cfg.port, collector)
        except ImportError as e:
            self._prom_off = True
            log.warning("metrics.prometheus: %s; no endpoint (pip install perdure[metrics], "
                        "or set metrics.prometheus = false)", e)  # fmt: skip
        except OSError as e:
            self._once("bind", f"metrics.port {self.cfg.port} on {self.host}: {e}; retrying")
        else:
            log.info("metrics endpoint on http://%s:%d/metrics", self.host, self.port)

    def _guard(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # an output's failure is never the run's
            self._once(what, f"metrics {what}: {type(e).__name__}: {e}")

    def _once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)
