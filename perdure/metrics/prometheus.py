"""The coordinator's Prometheus endpoint: the run's gauges and counters in the text format.

Served with ``prometheus_client`` (its WSGI app over a private registry, so nothing of
the process's default registry leaks in) by a small threaded HTTP server bound to
``cluster.host`` only, never to every interface. Every value is read at scrape time from
the latest :class:`~perdure.metrics.view.Snapshot`, which the metrics thread replaces
whole, so a scrape never sees half an update and never touches the coordinator's state.

A request is handled on its own thread with a socket timeout (``REQUEST_TIMEOUT_S``): a
client that sends nothing, a malformed request line or an oversized header gets an error
from ``http.server`` or is dropped, and the coordinator's own loop is never involved. Any
path answers with the metrics (as ``prometheus_client`` does); ``/favicon.ico`` is 404.

Metric names (all prefixed ``perdure_``): ``step``, ``steps_target``,
``steps_committed_total``, ``loss``, ``learning_rate`` (the first param group's),
``group_learning_rate{group}``, ``grad_norm``, ``loss_scale`` (``fp16`` only),
``step_seconds``,
``tokens_per_second``, ``members``, ``membership_epoch``, ``membership_changes_total``,
``faults_injected_total{kind,class}``, ``failures_observed_total{kind,scheduled}``,
``goodput``, ``eval_step``, ``eval{metric}`` (the last evaluation's metrics),
``train{metric}`` (the task's own metrics, ``Task.metrics``, at the last step),
``checkpoint_last_step``, ``checkpoints_saved_total``, ``run_ended``,
``coordinator_active{role}``; every one carries a ``run`` label (the run directory's
absolute path), so two runs on one host are told apart. A value the run does not know
yet (no step committed) is left out rather than reported as 0.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from perdure.metrics.view import Snapshot

REQUEST_TIMEOUT_S = 5.0
"""A connection that sends nothing for this long is closed (its thread ends)."""


class RunCollector:
    """A ``prometheus_client`` collector over the latest snapshot."""

    def __init__(
        self,
        latest: Callable[[], Snapshot],
        active: Callable[[], bool],
        role: str,
        steps: int,
        run: str = "",
    ) -> None:
        """``run``: the value of every metric's ``run`` label (the run directory), so
        that two runs scraped on one host are told apart."""
        self.latest, self.active, self.role, self.steps = latest, active, role, steps
        self.run = run

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.latest()
        gauges = [
            ("step", "The last committed step.", s.step),
            ("steps_target", "train.steps: the steps the run is to commit.", self.steps),
            ("loss", "Loss of the last committed step (its metrics line).", s.loss),
            ("learning_rate", "Learning rate of the last committed step.", s.lr),
            (
                "grad_norm",
                "Gradient norm of the last committed step, before optim.grad_clip.",
                s.grad_norm,
            ),
            (
                "loss_scale",
                "Loss scale of the last committed step (train.precision = fp16 only).",
                s.loss_scale,
            ),
            ("step_seconds", "Wall time of the last committed step.", s.step_s),
            ("tokens_per_second", "Tokens per second of the last committed step.", s.tokens_per_s),
            ("members", "Workers in the running membership epoch.", s.members),
            ("membership_epoch", "Number of the running membership epoch.", s.membership_epoch),
            (
                "goodput",
                "Committed steps at the median step time over the wall time they "
                "took (1.0: no time lost to faults).",
                s.goodput,
            ),
            ("checkpoint_last_step", "Step of the newest committed checkpoint.", s.checkpoint_step),
            ("run_ended", "1 once every member finished the last step.", int(s.run_ended)),
            ("eval_step", "Step after which the last evaluation ran.", s.eval_step),
        ]
        run = self.run
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"perdure_{name}", doc, labels=["run"])
            if value is not None:
                g.add_metric([run], float(value))
            yield g
        active = GaugeMetricFamily(
            "perdure_coordinator_active",
            "1 for the coordinator in charge of the run (a standby: 0 until it takes over).",
            labels=["run", "role"],
        )
        active.add_metric([run, self.role], 1.0 if self.active() else 0.0)
        yield active
        groups = GaugeMetricFamily(
            "perdure_group_learning_rate",
            "Learning rate of each optimizer param group at the last committed step (the "
            "task's scheduler's own value).",
            labels=["run", "group"],
        )
        for group, lr in sorted(s.lrs.items()):
            groups.add_metric([run, group], lr)
        yield groups
        evals = GaugeMetricFamily(
            "perdure_eval",
            "Each metric of the last evaluation on the held-out data set (eval/<metric> in "
            "metrics.jsonl; the task's eval_fn's, or its loss).",
            labels=["run", "metric"],
        )
        for metric, value in sorted(s.evals.items()):
            evals.add_metric([run, metric], value)
        yield evals
        own = GaugeMetricFamily(
            "perdure_train",
            "Each of the task's own training metrics at the last committed step "
            "(train/<metric> in metrics.jsonl; Task.metrics).",
            labels=["run", "metric"],
        )
        for metric, value in sorted(s.train.items()):
            own.add_metric([run, metric], value)
        yield own
        yield from _counters(s, CounterMetricFamily, run)


def _counters(s: Snapshot, family: Any, run: str) -> Iterator[Any]:
    for name, doc, value in (
        ("steps_committed", "Distinct steps committed in this launch.", s.steps_committed),
        (
            "membership_changes",
            "Epochs whose member set differed from the previous one.",
            s.membership_changes,
        ),
        ("checkpoints_saved", "Checkpoints committed in this launch.", s.checkpoints_saved),
    ):
        c = family(f"perdure_{name}", doc, labels=["run"])
        c.add_metric([run], float(value))
        yield c
    faults = family(
        "perdure_faults_injected", "Faults the schedule injected.", labels=["run", "kind", "class"]
    )
    for (kind, klass), n in sorted(s.faults.items()):
        faults.add_metric([run, kind, klass], float(n))
    yield faults
    failures = family(
        "perdure_failures_observed",
        "Failures the run's log shows (chaos/observed.py), scheduled by a fault or not.",
        labels=["run", "kind", "scheduled"],
    )
    for (kind, scheduled), n in sorted(s.failures.items()):
        failures.add_metric([run, kind, "true" if scheduled else "false"], float(n))
    yield failures


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news; errors are answered, not logged


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """The HTTP endpoint; binds in the constructor (``OSError`` if the port is taken)."""

    def __init__(self, host: str, port: int, collector: RunCollector) -> None:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        app = make_wsgi_app(registry)
        server = _Server6 if ":" in host else _Server
        self.httpd = make_server(host, port, app, server_class=server, handler_class=_Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            daemon=True,
            name="metrics-http",
        )
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
