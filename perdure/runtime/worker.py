"""The worker process: join, take part in membership epochs, run the step loop.

A worker holds a full replica. In each membership epoch it builds a process group under a
fresh store prefix, receives state if it is a joiner or fell behind, and runs steps:
compute its slots, reduce in slot order along the chain, check finiteness, apply the same
update as every other replica. It leaves the step loop when the coordinator announces a new
epoch (at once when a member failed, at a step boundary for joins and re-plans), when a
collective fails, or when the run is complete. It never restarts: a fault is a new epoch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from perdure import events as ev
from perdure.checkpoint import AsyncCheckpointer
from perdure.config.run import RunConfig, config_from_dict
from perdure.events import JsonLines
from perdure.runtime.channel import LineSocket, Listener, Message, connect
from perdure.runtime.comm import Abandoned, Comm, CommFailed
from perdure.runtime.exchange import StoreExchange
from perdure.runtime.plan import Plan
from perdure.runtime.priority import normal_priority
from perdure.runtime.reduce import chain_reduce
from perdure.runtime.slots import Readiness
from perdure.runtime.trainer import Trainer
from perdure.runtime.transfer import broadcast_state, pack, unpack
from perdure.runtime.wchaos import ChaosState

log = logging.getLogger("perdure.worker")


@dataclass
class Epoch:
    """What a member knows of the membership epoch it is running."""

    number: int
    plan: Plan
    rank: int
    start: Message
    comm: Comm
    ckpt: AsyncCheckpointer | None = None
    bufs: list[torch.Tensor] = field(default_factory=list)
    scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.plan.members)


class Worker:
    """One training process. ``run()`` returns the process exit code."""

    def __init__(
        self,
        *,
        name: str,
        region: str,
        coordinators: list[tuple[str, int]],
        token: str,
        role: str = "worker",
        timeout_s: float = 60.0,
        restore_priority: bool = False,
    ) -> None:
        self.name, self.region, self.role = name, region, role
        self.restore_priority = restore_priority
        self.coordinators, self.token, self.timeout_s = coordinators, token, timeout_s
        self.cond = threading.Condition()
        self.announce: Message | None = None
        self.starts: dict[int, Message] = {}
        self.stopped = False
        self.lost = False
        self.epoch_no = -1
        self.inflight = -1
        self.has_state = False
        self.slot_s: float | None = None
        self.chaos = ChaosState()
        self.trainer: Trainer | None = None
        self.line: LineSocket | None = None
        self.final_saved = -1
        self.leaving = False
        self.suspects: dict[str, int] = {}

    def leave(self) -> None:
        """Graceful stop (SIGTERM): ask to be left out at the next step boundary."""
        self.leaving = True
        self._send({"type": "leave"})

    # -- connection ------------------------------------------------------------------------

    def _hello(self) -> Message:
        t = self.trainer
        return {
            "name": self.name,
            "region": self.region,
            "role": self.role,
            "pid": os.getpid(),
            "next_step": t.next_step if t else 0,
            "has_state": self.has_state,
            "epoch": self.epoch_no,
        }

    def _connect(self) -> Message:
        end = time.monotonic() + self.timeout_s
        last: Exception | None = None
        while time.monotonic() < end:
            for host, port in self.coordinators:
                try:
                    line, welcome = connect(host, port, self.token, self._hello(), 5.0)
                except (OSError, ConnectionError) as e:
                    last = e
                    continue
                self.line, self.host = line, host
                with self.cond:
                    self.lost, self.announce = False, None
                Listener(line, self._on_message, self._on_lost).start()
                return welcome
            time.sleep(0.1)
        raise ConnectionError(
            f"{self.name}: no coordinator reachable at {self.coordinators}: {last}"
        )

    def _on_message(self, msg: Message) -> None:
        with self.cond:
            kind = msg.get("type")
            if kind == "epoch":
                self.announce = msg
            elif kind == "start":
                self.starts[int(msg["epoch"])] = msg
            elif kind == "stop":
                self.stopped = True
            self.cond.notify_all()

    def _on_lost(self) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()

    def _send(self, msg: Message) -> None:
        try:
            if self.line is not None:
                self.line.send(msg)
        except OSError:
            self._on_lost()

    # -- main ------------------------------------------------------------------------------

    def run(self) -> int:
        welcome = self._connect()
        config = config_from_dict(welcome["config"])
        self.run_dir = Path(welcome["run_dir"])
        self.store_port = int(welcome["store_port"])
        self.events = JsonLines(self.run_dir / "events.jsonl")
        self.metrics = JsonLines(self.run_dir / "metrics.jsonl")
        self.config: RunConfig = config
        # Beat from admission on: building the trainer can take seconds on a busy machine.
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        self.trainer = Trainer(
            config, cache_dir=str(self.run_dir / "cache"), poison=_poison_schedule(config)
        )
        if welcome.get("resume"):
            self.trainer.load(welcome["resume"])
        # A worker admitted before the first epoch holds valid initial state (built from the
        # seed, or loaded); one admitted later is a joiner and receives state from a peer.
        self.has_state = self.role == "worker" and int(welcome.get("epoch", -1)) < 0
        if not self.has_state:
            self.trainer.warm_up()  # before it may be promoted, at its start-up priority
        if self.restore_priority:
            normal_priority()
        self._send({"type": "hb", "next_step": self.trainer.next_step, "prepared": True})
        try:
            self._loop()
        finally:
            self.trainer.close()
        return 0

    def _loop(self) -> None:
        while True:
            msg = self._next_announcement()
            if msg is None:
                return
            if self.name not in msg["members"]:
                self.epoch_no = int(msg["epoch"])  # not a member: idle until included
                if self.leaving:
                    self.events.write(
                        {
                            "event": ev.LEFT,
                            "worker": self.name,
                            "next_step": self.trainer.next_step if self.trainer else 0,
                        }
                    )
                    return
                continue
            start = self._ready(msg)
            if start is not None:
                self._run_epoch(start)

    def _next_announcement(self) -> Message | None:
        """Block until an announcement newer than the current epoch (None: stop)."""
        with self.cond:
            while True:
                if self.stopped:
                    return None
                if self.lost:
                    self.cond.release()
                    try:
                        self._reconnect()
                    finally:
                        self.cond.acquire()
                    continue
                a = self.announce
                if a is not None and int(a["epoch"]) > self.epoch_no:
                    return a
                self.cond.wait(timeout=1.0)

    def _reconnect(self) -> None:
        """The coordinator is gone (or evicted us): reach it or its standby again."""
        self.events.write({"event": ev.RECONNECT, "worker": self.name, "epoch": self.epoch_no})
        welcome = self._connect()
        self.store_port = int(welcome["store_port"])

    def _ready(self, msg: Message) -> Message | None:
        """Report ready for the announced epoch and wait for its start (None: superseded)."""
        e = int(msg["epoch"])
        assert self.trainer is not None
        self._send(
            {
                "type": "ready",
                "epoch": e,
                "next_step": self.trainer.next_step,
                "has_state": self.has_state,
            }
        )
        with self.cond:
            while e not in self.starts:
                a = self.announce
                if self.stopped or self.lost or (a is not None and int(a["epoch"]) > e):
                    self.epoch_no = e
                    return None
                self.cond.wait(timeout=1.0)
            self.epoch_no = e
            return self.starts.pop(e)

    # -- one membership epoch --------------------------------------------------------------

    def _should_stop(self, step: int) -> bool:
        """True when the step ``step`` must not run (or be abandoned) in this epoch."""
        if self.stopped or self.lost:
            return True
        a = self.announce
        if a is None or int(a["epoch"]) <= self.epoch_no:
            return False
        after = int(a["after"])
        return after < 0 or after <= step

    def _run_epoch(self, start: Message) -> None:
        assert self.trainer is not None
        plan = Plan.from_dict(start["plan"])
        rank = plan.members.index(self.name)
        store = dist.TCPStore(
            self.host, self.store_port, is_master=False, timeout=timedelta(seconds=self.timeout_s)
        )
        self.inflight = self.trainer.next_step
        abort = lambda: self._should_stop(self.inflight)  # noqa: E731
        try:
            comm = Comm(store, start["prefix"], rank, len(plan.members), self._timeout(), abort)
        except (Abandoned, CommFailed) as e:
            self._failed(e)
            return
        ep = Epoch(int(start["epoch"]), plan, rank, start, comm)
        try:
            self._transfer(ep)
            ep.ckpt = self._checkpointer(ep)
            self._steps(ep)
        except Abandoned:
            self.events.write(
                {
                    "event": ev.STEP_ABANDONED,
                    "worker": self.name,
                    "step": self.inflight,
                    "epoch": ep.number,
                }
            )
        except CommFailed as e:
            self._failed(e)
        finally:
            self._close_epoch(ep)

    def _failed(self, e: Exception) -> None:
        self._send({"type": "fail", "epoch": self.epoch_no, "error": str(e)})
        log.warning("%s: collective failed in epoch %d: %s", self.name, self.epoch_no, e)

    def _timeout(self) -> timedelta:
        """Adaptive collective timeout: well above the detection horizon and ten recent
        step times, so that only a stuck collective ever hits it."""
        c = self.config.cluster
        horizon = (c.acceptable_pause_ms + 10 * c.heartbeat_ms) / 1000
        step = 10 * (self.slot_s or 0) * self.config.train.slots
        return timedelta(seconds=max(c.min_collective_timeout_ms / 1000, 2 * horizon, step))

    def _transfer(self, ep: Epoch) -> None:
        if ep.start.get("recover"):
            self._reload(ep.start.get("reload"))
            return
        receivers = ep.start["receivers"]
        if not receivers:
            return
        assert self.trainer is not None
        src = ep.plan.members.index(ep.start["source"])
        t0 = time.monotonic()
        payload = pack(*self.trainer.export()) if ep.rank == src else None
        head, blob = broadcast_state(ep.comm, src, payload, self._timeout())
        if self.name in receivers:
            self.trainer.adopt(*unpack(head, blob))
            self.has_state = True
            self.events.write(
                {
                    "event": ev.STATE_RECEIVED,
                    "worker": self.name,
                    "from": ep.start["source"],
                    "bytes": int(blob.numel()),
                    "seconds": round(time.monotonic() - t0, 4),
                    "next_step": self.trainer.next_step,
                }
            )

    def _reload(self, path: str | None) -> None:
        """Every replica was lost: start again from a checkpoint (or from the seed)."""
        assert self.trainer is not None
        if path is not None:
            self.trainer.load(path)
        elif self.trainer.next_step != 0 or self.has_state:
            raise RuntimeError("no checkpoint to recover from, and this replica is not at step 0")
        self.has_state = True

    def _checkpointer(self, ep: Epoch) -> AsyncCheckpointer:
        ex = StoreExchange(
            self.host,
            self.store_port,
            ep.start["prefix"],
            ep.rank,
            ep.size,
            lambda: self._should_stop(self.inflight),
        )
        return AsyncCheckpointer(
            self.run_dir / "checkpoints",
            self.config.checkpoint,
            rank=ep.rank,
            world=ep.size,
            exchange=ex,
            log=self._ckpt_log if ep.rank == 0 else None,
        )

    def _ckpt_log(self, record: dict[str, Any]) -> None:
        self.events.write({**record, "worker": self.name})

    def _close_epoch(self, ep: Epoch) -> None:
        ep.comm.close()
        if ep.ckpt is not None:
            try:
                ep.ckpt.wait()
                ep.ckpt.check()
            except Exception as e:  # a save cut short by the membership change
                self.events.write(
                    {"event": ev.CHECKPOINT_ABANDONED, "worker": self.name, "error": str(e)[:200]}
                )
            ep.ckpt.close()

    def _steps(self, ep: Epoch) -> None:
        assert self.trainer is not None
        steps = self.config.train.steps
        while self.trainer.next_step < steps:
            t = self.trainer.next_step
            self.inflight = t
            if self._should_stop(t):
                return
            self._step(ep, t)
        self._finish(ep)

    def _step(self, ep: Epoch, t: int) -> None:
        tr = self.trainer
        assert tr is not None and ep.ckpt is not None
        ep.ckpt.check()
        t0 = time.monotonic()
        tr.poison_due(t)
        slots = ep.plan.slots_of(ep.rank)
        total = self._reduced_gradient(ep, t, slots, t0)
        ep.ckpt.wait_snapshot()
        loss = tr.apply(t, total)
        step_s = time.monotonic() - t0
        if ep.rank == 0:
            self._metrics(ep, t, loss, step_s)
        every = self.config.cluster.fingerprint_every
        if ep.size > 1 and tr.next_step % every == 0:
            self._compare_fingerprints(ep)
        ck = self.config.checkpoint.every_steps
        if ck and tr.next_step % ck == 0 and tr.next_step < self.config.train.steps:
            ep.ckpt.save(tr.checkpoint_state(self._topology(ep)))

    def _reduced_gradient(self, ep: Epoch, t: int, slots: range, t0: float) -> torch.Tensor:
        """Compute, reduce, and handle non-finite slots until step ``t`` has a clean sum.

        The reduction starts once every slot but the last is computed, and streams behind
        the last slot's backward (as DDP overlaps its buckets): a chunk is added as soon as
        every gradient laid out in it is final.
        """
        tr = self.trainer
        assert tr is not None
        abort = lambda: self._should_stop(t)  # noqa: E731
        tr.prefetch(t + 1, slots)
        while True:
            if len(ep.bufs) != len(slots):
                ep.bufs = [tr.engine.new_buffer() for _ in slots]
            if not tr.compute_slots(t, slots[:-1], ep.bufs[:-1], abort):
                raise Abandoned("membership epoch changed during compute")
            delay = self.chaos.delay_s()
            ready = Readiness()
            fut = self._start_reduce(ep, ep.bufs, delay, ready, abort)
            if not tr.compute_slots(t, slots[-1:], ep.bufs[-1:], abort, ready=ready):
                raise Abandoned("membership epoch changed during compute")
            busy = time.monotonic() - t0 + delay
            self.slot_s = (
                busy / len(slots)
                if self.slot_s is None
                else (0.7 * self.slot_s + 0.3 * busy / len(slots))
            )
            total = ep.comm.result(fut)
            bad = tr.engine.bad_slots(total)
            if not bad:
                return total
            self._on_nonfinite(ep, t, bad)

    def _reduce(self, ep: Epoch, bufs: list[torch.Tensor]) -> torch.Tensor:
        """The slot-ordered sum of every member's ``bufs`` (all final already)."""
        return ep.comm.result(self._start_reduce(ep, bufs, 0.0, None, lambda: False))

    def _start_reduce(
        self,
        ep: Epoch,
        bufs: list[torch.Tensor],
        delay: float,
        ready: Readiness | None,
        abort: Callable[[], bool],
    ) -> Future[torch.Tensor]:
        """Start the chain reduction on the comm thread. Scratch buffers live as long as
        the epoch: an abandoned collective may still write into the old epoch's."""
        n = bufs[0].numel()
        if n not in ep.scratch:
            ep.scratch[n] = (torch.empty(n), torch.empty(n))
        partial, out = ep.scratch[n]
        if self.chaos.take_comm_error():
            self.events.write({"event": ev.FAULT_HIT, "kind": "comm_error", "worker": self.name})
            raise CommFailed("injected link drop (comm_error)")
        timeout = self._timeout()
        wait = (
            None if ready is None else (lambda hi: ready.wait(hi, abort, timeout.total_seconds()))
        )

        def run() -> torch.Tensor:
            chain_reduce(
                ep.comm.pg,
                ep.rank,
                ep.size,
                bufs,
                partial,
                out,
                timeout=timeout,
                send_delay_s=delay,
                wait_last=wait,
            )
            return out

        return ep.comm.submit(run)

    def _on_nonfinite(self, ep: Epoch, t: int, bad: list[int]) -> None:
        """Re-run each bad slot on another member to tell bad data from a bad worker."""
        tr = self.trainer
        assert tr is not None
        per = self.config.train.slot_size
        S = self.config.train.slots
        vec = torch.zeros(S * per)
        owner = {s: r for r in range(ep.size) for s in ep.plan.slots_of(r)}
        for s in bad:
            if (owner[s] + 1) % ep.size == ep.rank:
                flags = tr.rerun_flags(t, s)
                vec[s * per : (s + 1) * per] = torch.tensor(flags, dtype=torch.float32)
        verdict = self._reduce(ep, [vec])
        found: dict[int, list[bool]] = {}
        for s in bad:
            flags = [bool(x) for x in verdict[s * per : (s + 1) * per]]
            if any(flags):
                found[s] = flags
            else:
                self._suspect(ep, t, s, ep.plan.members[owner[s]])
        if found:
            entry = tr.quarantine(t, found)
            if ep.rank == 0:
                self.events.write({"event": ev.DECISION, **entry})

    def _suspect(self, ep: Epoch, step: int, slot: int, worker: str) -> None:
        """A non-finite slot that did not reproduce elsewhere: the worker, not the data.
        Its result is discarded (the step is recomputed); past the configured count it is
        evicted. Every member counts identically, so rank 0 alone reports."""
        self.suspects[worker] = self.suspects.get(worker, 0) + 1
        if ep.rank != 0:
            return
        self.events.write(
            {
                "event": ev.SUSPECT_WORKER,
                "step": step,
                "slot": slot,
                "worker": worker,
                "count": self.suspects[worker],
            }
        )
        if self.suspects[worker] >= self.config.cluster.evict_after_suspect:
            self._send({"type": "evict", "worker": worker, "reason": "non-finite results"})

    def _compare_fingerprints(self, ep: Epoch) -> None:
        assert self.trainer is not None
        mine = torch.tensor([self.trainer.fingerprint()], dtype=torch.int64)
        outs = [torch.zeros(1, dtype=torch.int64) for _ in range(ep.size)]
        timeout = self._timeout()
        ep.comm.call(lambda: ep.comm.pg.allgather([outs], [mine]).wait(timeout))
        values = [int(o) for o in outs]
        if len(set(values)) > 1:
            majority = max(set(values), key=values.count)
            odd = [m for m, v in zip(ep.plan.members, values, strict=True) if v != majority]
            self.events.write(
                {"event": ev.REPLICA_DIVERGED, "step": self.trainer.next_step, "workers": odd}
            )
            if self.name in odd:
                self.has_state = False  # receive a live peer's state in the next epoch
                raise CommFailed(f"replica diverged at step {self.trainer.next_step}")

    def _metrics(self, ep: Epoch, t: int, loss: float, step_s: float) -> None:
        tokens = self.config.train.global_batch * self.trainer.dataset.seq_len  # type: ignore[union-attr]
        self.metrics.write(
            {
                "step": t,
                "loss": loss,
                "step_s": round(step_s, 6),
                "tokens_per_s": round(tokens / step_s, 1) if step_s > 0 else None,
                "membership_epoch": ep.number,
                "slots": ep.plan.counts(),
                "members": list(ep.plan.members),
            }
        )

    def _topology(self, ep: Epoch) -> dict[str, Any]:
        return {
            "regions": [r.name for r in self.config.cluster.regions],
            "workers": list(ep.plan.members),
            "membership_epoch": ep.number,
            "plan": ep.plan.to_dict(),
        }

    def _finish(self, ep: Epoch) -> None:
        """The final checkpoint (all members write it in parallel), then report done."""
        tr = self.trainer
        assert tr is not None and ep.ckpt is not None
        if self.final_saved != tr.next_step:
            ep.ckpt.wait()
            ep.ckpt.save(tr.checkpoint_state(self._topology(ep)))
            ep.ckpt.wait()
            ep.ckpt.check()
            self.final_saved = tr.next_step
        self._send(
            {
                "type": "done",
                "next_step": tr.next_step,
                "info": {"final_hash": tr.digest(), "step": tr.next_step},
            }
        )

    # -- heartbeats ------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        interval = self.config.cluster.heartbeat_ms / 1000
        store: dist.TCPStore | None = None
        while not self.stopped:
            time.sleep(interval)
            try:
                store = store or dist.TCPStore(
                    self.host, self.store_port, is_master=False, timeout=timedelta(seconds=5)
                )
                self.chaos.poll(store, self.name, self.region, self.events)
            except (RuntimeError, dist.DistError):
                store = None
            delay = self.chaos.delay_s()
            if delay:
                time.sleep(delay)
            t = self.trainer
            self._send(
                {
                    "type": "hb",
                    "next_step": t.next_step if t else 0,
                    "slot_s": self.slot_s,
                    "prepared": t is not None,
                }
            )


def _poison_schedule(config: RunConfig) -> list[tuple[int, int]]:
    return [
        (int(f.target), int(f.at_step or 0))
        for f in config.chaos.faults
        if f.kind == "poison_shard"
    ]
