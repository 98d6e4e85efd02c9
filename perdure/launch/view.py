"""The live terminal view of a local run: progress, loss, throughput, regions, events.

It only reads the run's own logs (metrics.jsonl, events.jsonl) and the launcher's roster
(``launch/base.py``: its regions and workers), so what it shows is what a post-mortem would
see, and it works with any launcher: it is a monitor hook, refreshed on every tick.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from perdure import events as ev
from perdure.events import Tail
from perdure.launch.base import Roster, WorkerState

_SHOWN = {
    ev.FAULT_INJECTED: "red",
    ev.FAULT_ENDED: "yellow",
    ev.LEAVE: "red",
    ev.JOIN: "green",
    ev.EPOCH_STARTED: "cyan",
    ev.STATE_RECEIVED: "green",
    ev.SPARE_PROMOTED: "green",
    ev.COORDINATOR_TAKEOVER: "magenta",
    ev.DECISION: "magenta",
    ev.CHECKPOINT_SAVED: "blue",
    ev.STEP_ABANDONED: "yellow",
    ev.RUN_END: "bold green",
}


def describe(e: dict[str, Any]) -> str:
    """One line per event, for people."""
    kind = e["event"]
    if kind == ev.FAULT_INJECTED:
        return f"fault: {e['kind']} {e['target']} at step {e.get('step')}"
    if kind == ev.EPOCH_STARTED:
        n = len(e["plan"]["members"])
        epoch, start = e["epoch"], e["start_step"]
        return f"membership epoch {epoch}: {n} workers from step {start} ({e['reason']})"
    if kind == ev.STATE_RECEIVED:
        return f"{e['worker']} copied state from {e['from']} in {e['seconds']:.3f} s"
    if kind == ev.DECISION:
        return f"quarantined parts {ev.decision_parts(e)} at step {e['step']}"
    if kind == ev.CHECKPOINT_SAVED:
        return f"checkpoint step {e['step']} ({e['seconds']:.2f} s in background)"
    rest = {k: v for k, v in e.items() if k not in ("t", "event", "pid", "pids", "plan")}
    return f"{kind} " + " ".join(f"{k}={v}" for k, v in rest.items())


class LiveView:
    """Refreshes a rich Live display from the run directory; a monitor hook."""

    def __init__(
        self, run_dir: Path, steps: int, roster: Roster, console: Console | None = None
    ) -> None:
        self.roster = roster
        self.metrics = Tail(run_dir / "metrics.jsonl", from_end=True)
        self.events = Tail(run_dir / "events.jsonl", from_end=True)
        self.steps = steps
        self.last: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        """The last evaluation's line (``eval_step``, ``eval/<name>``)."""
        self.log: deque[tuple[float, str, str]] = deque(maxlen=12)
        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task("train", total=steps)
        self.live = Live(console=console or Console(), refresh_per_second=8, transient=False)
        self.started = time.time()
        self.last_draw = 0.0

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(None, None, None)

    def tick(self) -> None:
        for m in self.metrics.read():
            if isinstance(m.get("step"), int):
                self.last = m
            elif isinstance(m.get("eval_step"), int):
                self.last_eval = m
        for e in self.events.read():
            if e["event"] in _SHOWN:
                self.log.append((e["t"], _SHOWN[e["event"]], describe(e)))
        if self.last:
            self.progress.update(self.task, completed=self.last["step"] + 1)
        if time.time() - self.last_draw > 0.1:
            self.last_draw = time.time()
            self.live.update(self.render())

    def render(self) -> Panel:
        m = self.last
        head = Table.grid(padding=(0, 3))
        head.add_row(
            f"loss [bold]{m.get('loss', float('nan')):.4f}[/]",
            f"tokens/s [bold]{m.get('tokens_per_s') or 0:,.0f}[/]",
            f"step time [bold]{1000 * m.get('step_s', 0):.0f} ms[/]",
            f"membership epoch [bold]{m.get('membership_epoch', '-')}[/]",
        )
        parts: list[Any] = [self.progress, head]
        own = [f"{k} [bold]{v:.4f}[/]" for k, v in sorted(m.items())
               if k.startswith("train/") and isinstance(v, int | float)]  # fmt: skip
        if own:  # the task's own metrics (Task.metrics)
            parts.append("   ".join(own))
        if self.last_eval:
            e = self.last_eval
            shown = [f"{k} [bold]{v:.4f}[/]" for k, v in sorted(e.items())
                     if k.startswith("eval/") and isinstance(v, int | float)]  # fmt: skip
            parts.append(f"after step {e['eval_step']}: " + "   ".join(shown))
        return Panel(
            Group(*parts, self._regions(m), self._log()),
            title="perdure run",
            border_style="cyan",
        )

    def _regions(self, m: dict[str, Any]) -> Table:
        t = Table(box=None, padding=(0, 2), show_header=True, header_style="bold")
        t.add_column("region")
        t.add_column("workers (slots)")
        members = dict(zip(m.get("members", []), m.get("slots", []), strict=False))
        workers = self.roster.workers()
        for region in self.roster.regions():
            cells = [_cell(w, members) for w in workers if w.region == region]
            t.add_row(region, "  ".join(cells))
        return t

    def _log(self) -> Table:
        t = Table(box=None, show_header=False, padding=(0, 1))
        for ts, style, text in self.log:
            t.add_row(f"{ts - self.started:7.2f}s", f"[{style}]{text}[/]")
        return t


def _cell(w: WorkerState, members: dict[str, int]) -> str:
    if not w.alive:
        return f"[red]{w.name} down[/]"
    if w.name in members:
        return f"[green]{w.name}[/] ({members[w.name]})"
    return f"[yellow]{w.name} idle[/]"
