"""The worker process: join, take part in membership epochs, run the step loop.

A worker holds a full replica. It composes three parts: the membership client (the channel
to the coordinator: admission, notices, heartbeats, reconnection), the trainer (the
replica's state and step math) and, in each membership epoch, a step runner (slot buffers,
the reduction, non-finite flags, fingerprints) over a process group built under a fresh
store prefix. It leaves an epoch when the coordinator announces a new one (at once when a
member failed, at a step boundary for joins and re-plans), when a collective fails, or
when the run is complete. It never restarts: a fault is a new epoch.

It works for one coordinator generation at a time (its epoch's ``start`` says which) and
checks the run directory's fence (``control/fence.py``) before every step, on every
heartbeat, and before a checkpoint commit: once a newer coordinator took over, it begins
no step, commits no checkpoint, and leaves for the newer coordinator, keeping its state
(every step it completed was begun under a generation the fence still allowed).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from perdure import events as ev
from perdure.chaos.faults.corrupt_part import CORRUPT_PART
from perdure.chaos.faults.poison_part import POISON_PART
from perdure.checkpoint import (
    config_override_entry,
)
from perdure.checkpoint.config import checkpoint_root
from perdure.checkpoint.ranges import open_lazy
from perdure.data import DataError
from perdure.events import Tail
from perdure.proctitle import set_title
from perdure.run_config import RunConfig, config_from_dict
from perdure.runlog import part, writer_id
from perdure.runtime.comm.group import Abandoned, Comm, CommFailed, wake_waits
from perdure.runtime.comm.reducer import direct_leaders, make_reducer, uses_tiers
from perdure.runtime.comm.swarm import SwarmCopy
from perdure.runtime.control import protocol as p
from perdure.runtime.control.address import interface_address
from perdure.runtime.control.auth_store import AuthStore
from perdure.runtime.control.channel import UNACKED_S
from perdure.runtime.control.client import Identity, MembershipClient
from perdure.runtime.control.fence import Fence, Fenced
from perdure.runtime.control.liveness import hold
from perdure.runtime.member import saves
from perdure.runtime.member.epoch import Epoch
from perdure.runtime.member.heartbeat import Heartbeat
from perdure.runtime.member.metrics import Evaluation, step_line
from perdure.runtime.member.priority import normal_priority, prompt_threads
from perdure.runtime.member.shard_group import Shards, optimizer_params
from perdure.runtime.member.transfer import StateTransfer
from perdure.runtime.member.wchaos import ChaosState, DiskFiller
from perdure.runtime.plan import Plan
from perdure.runtime.replica.placement import Placement
from perdure.runtime.replica.salvage import SlotSalvage
from perdure.runtime.replica.trainer import MathError, Trainer
from perdure.runtime.shard_plan import NONE, group_of, shard_of
from perdure.runtime.step import Seams, SlotTimer, StepEnd, StepRunner, train_step

log = logging.getLogger("perdure.worker")


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
        host: str | None = None,
        interface: str | None = None,
        device_index: int | None = None,
    ) -> None:
        self.name, self.region, self.role = name, region, role
        self.device_index = device_index
        self.interface = interface
        self.host = interface_address(interface) if interface else host
        """The data plane's address, when given (else: the address on the path to the
        coordinator, found once connected)."""
        self.restore_priority = restore_priority
        self.timeout_s = timeout_s
        self.client = MembershipClient(
            Identity(name, region, role),
            coordinators,
            token,
            timeout_s=timeout_s,
            progress=self._progress,
            address=self.host,
        )
        self.client.on_notice = wake_waits  # a survivor leaves its collective at once
        self.inflight = -1
        self.has_state = False
        self.timer = SlotTimer()
        self.chaos = ChaosState()
        self.trainer: Trainer | None = None
        self.shards: Shards | None = None
        """This epoch's replica group (``train.shard_degree`` > 1)."""
        self.final_saved = -1
        self.leaving = False
        self.suspects: dict[str, int] = {}
        self.salvage = SlotSalvage()

    def leave(self) -> None:
        """Graceful stop (SIGTERM): ask to be left out at the next step boundary."""
        self.leaving = True
        self.client.send(p.Leave())

    def _progress(self) -> tuple[int, bool]:
        return (self.trainer.next_step if self.trainer else 0), self.has_state

    @property
    def stopped(self) -> bool:
        return self.client.stopped

    # -- main ------------------------------------------------------------------------------

    def run(self) -> int:
        prompt_threads()
        welcome = self.client.connect()
        self.run_dir = Path(welcome.run_dir)
        # The kernel releases this lock as it begins to end a killed process: the
        # coordinator on this host sees the death before the sockets close (~10 ms here).
        alive = hold(self.run_dir, self.name)
        try:
            return self._run(welcome)
        finally:
            if alive is not None:
                alive.release()  # an exit of its own: no death notice

    def _run(self, welcome: p.Welcome) -> int:
        config = config_from_dict(welcome.config)
        set_title("spare" if self.role == "spare" else "worker", self.name, welcome.run_dir)
        self.store_port = welcome.store_port
        writer = writer_id(self.name)  # a part file each: safe on a network file system
        self.events = part(self.run_dir, "events", writer)
        self.metrics = part(self.run_dir, "metrics", writer)
        self.client.run_over = RunEndWatch(self.run_dir / "events.jsonl")
        self.fence = Fence(self.run_dir)
        self.config: RunConfig = config
        pause_s = config.cluster.acceptable_pause_ms / 1000
        self.client.set_unacked_limit(max(UNACKED_S, 2 * pause_s))
        local = self.device_index
        if local is None:
            local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        self.placement = Placement.of(config.train, config.cluster, local)
        self.chaos.arm(config.chaos)
        if any(f.kind == "disk_full" for f in config.chaos.faults):
            ckpts = checkpoint_root(config.checkpoint, self.run_dir)
            self.chaos.filler = DiskFiller(Path(ckpts), self.name)
        self.evaluation = Evaluation(config, self.run_dir, self.placement, self.name)
        self.transfer = StateTransfer(
            name=self.name,
            events=self.events,
            state_copy=SwarmCopy(),  # how a joiner gets a live replica's state
            shard_degree=config.train.shard_degree,
            timeout=self._timeout,
            should_stop=lambda: self._should_stop(self.inflight),
            copy_pace=config.cluster.copy_pace,
            copy_step_bytes=int(config.cluster.copy_step_mb * 1e6),
            steps=config.train.steps,
            slot_s=lambda: self.timer.slot_s,
        )
        # Beat from admission on: building the trainer can take seconds on a busy machine.
        threading.Thread(target=self._heartbeat().run, daemon=True, name="heartbeat").start()
        self.trainer = self._new_trainer()
        self.allow_config_change = welcome.allow_config_change
        if welcome.resume:
            self._load(welcome.resume)
        # A worker admitted before the first epoch holds valid initial state (built from the
        # seed, or loaded); one admitted later is a joiner and receives state from a peer.
        self.has_state = self.role == "worker" and welcome.epoch < 0
        if not self.has_state:
            self.trainer.warm_up()  # before it may be promoted, at its start-up priority
        if self.restore_priority:
            normal_priority()
        self.client.send(p.Heartbeat(next_step=self.trainer.next_step, prepared=True))
        try:
            self._loop()
        finally:
            self.trainer.close()
            self.evaluation.close()
            if self.chaos.filler is not None:
                self.chaos.filler.remove()
        return 0

    def _loop(self) -> None:
        while True:
            msg = self.client.next_announcement(self._on_reconnect)
            if msg is None:
                return
            if self.name not in msg.members:
                self.client.epoch_no = msg.epoch  # not a member: idle until included
                if self.leaving:
                    self._left()
                    return
                continue
            start = self._ready(msg)
            if start is not None:
                self._run_epoch(start)

    def _left(self) -> None:
        step = self.trainer.next_step if self.trainer else 0
        self.events.write({"event": ev.LEFT, "worker": self.name, "next_step": step})

    def _on_reconnect(self, welcome: p.Welcome) -> None:
        """The coordinator is gone (or evicted us) and we reached it or its standby again."""
        self.events.write(
            {"event": ev.RECONNECT, "worker": self.name, "epoch": self.client.epoch_no}
        )
        self.store_port = welcome.store_port

    def _ready(self, msg: p.Announce) -> p.Start | None:
        """Report ready for the announced epoch and wait for its start (None: superseded)."""
        assert self.trainer is not None
        if self.trainer.torn:
            self.has_state = False  # half of an update or of a copy: receive a whole state
        held = self.trainer.held if self.has_state else NONE
        t = self.trainer.next_step
        kept = self.salvage.held((t, self.trainer.state_version)) if self.has_state else []
        ready = p.Ready(
            epoch=msg.epoch,
            next_step=t,
            has_state=self.has_state,
            shard=held,
            kept=kept[: p.MAX_LIST],
        )
        self.client.send(ready)
        return self.client.wait_start(msg.epoch)

    # -- one membership epoch --------------------------------------------------------------

    def _should_stop(self, step: int) -> bool:
        return self.client.should_stop(step)

    def _store(self, timeout_s: float | None = None) -> dist.Store:
        """A connection to the run's store (through the run token; see control/store.py)."""
        t = timedelta(seconds=timeout_s or self.timeout_s)
        return AuthStore(self.client.host, self.store_port, self.client.token, t)

    def _run_epoch(self, start: p.Start) -> None:
        assert self.trainer is not None
        plan = Plan.from_dict(start.plan)
        rank = plan.members.index(self.name)
        self.inflight = self.trainer.next_step
        abort = lambda: self._should_stop(self.inflight)  # noqa: E731

        try:
            store = self._store()
            comm = Comm(
                store,
                start.prefix,
                rank,
                len(plan.members),
                self._timeout(),
                abort,
                backend=self.placement.backend,
                bind=self.host or self.client.local_address(),
                interface=self.interface,
                device=self.placement.buffers,
            )
            if uses_tiers(self.config.train, self.config.cluster.hierarchical_reduce):
                cluster, diloco = self.config.cluster, self.config.outer.on
                direct = direct_leaders(cluster.cross_region_reduce, diloco)
                comm.add_tiers(store, self.region, direct=direct)
            self._shard_group(store, comm, rank)
            first = (start.start_step, Plan.from_dict(start.first)) if start.first else None
        except (Abandoned, CommFailed, dist.DistError) as e:
            # DistError: the run's store unreachable or failing (its coordinator died as
            # the epoch started): a fault of the control plane, reported like a failed
            # collective; the worker keeps its state and finds the standby. It raised out
            # of the worker before (a survivor's exit, and its state lost with it).
            if self.shards is not None:  # its groups, as far as they were built
                self.shards.close()
                self.shards = None
                self.trainer.shards = None
            if "comm" in locals():
                comm.close()
            self._failed(e)
            return
        runner = self._runner(plan, rank, comm, first)
        ep = Epoch(start.epoch, plan, rank, start, comm, runner)
        runner.settled = lambda t, loss, step_s: self._line(ep, t, loss, step_s)
        try:
            self._transfer(ep)
            ep.ckpt = saves.checkpointer(
                ep,
                config=self.config,
                run_dir=self.run_dir,
                store=self._store,
                should_stop=self.client.save_must_stop,
                fence=self.fence,
                events=self.events,
                name=self.name,
            )
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
        except (CommFailed, dist.DistError) as e:
            self._failed(e)
        except Fenced as e:
            self._fenced(e.newer, str(e))
        except (MathError, DataError) as e:  # every replica would meet it: the run stops
            log.error("%s: %s", self.name, e)
            self.client.send(p.Abort(reason=str(e)[: p.MAX_STR]))
        finally:
            self._log_repairs()
            self._close_epoch(ep)

    def _fenced(self, newer: int, why: str) -> None:
        """A newer coordinator took over: leave this one (once per generation)."""
        old = self.client.generation
        if self.client.fenced_by(newer):
            log.warning("%s: %s", self.name, why)
            self.events.write(
                {"event": ev.WORKER_FENCED, "worker": self.name, "generation": old, "newer": newer}
            )

    def _runner(
        self, plan: Plan, rank: int, comm: Comm, first: tuple[int, Plan] | None = None
    ) -> StepRunner:
        assert self.trainer is not None
        seams = Seams(
            name=self.name,
            events=self.events,
            timeout=self._timeout,
            should_stop=self._should_stop,
            evict=lambda w, why: self.client.send(p.Evict(worker=w, reason=why)),
            delay_s=self.chaos.delay_s,
            take_comm_error=self.chaos.take_comm_error,
            evict_after=self.config.cluster.evict_after_suspect,
            suspects=self.suspects,
            salvage=self.salvage,
        )
        scatter = self.shards.scatter if self.shards is not None else None
        tiered = comm.tiers is not None
        reducer = make_reducer(self.config.train, rank, len(plan.members), scatter, tiered=tiered)
        return StepRunner(self.trainer, plan, rank, comm, reducer, seams, self.timer, first)

    def _failed(self, e: Exception) -> None:
        epoch = self.client.epoch_no
        self.client.send(p.Fail(epoch=epoch, error=str(e)[: p.MAX_STR]))
        log.warning("%s: collective failed in epoch %d: %s", self.name, epoch, e)

    def _timeout(self) -> timedelta:
        """Adaptive collective timeout: well above the detection horizon and ten recent
        step times, so that only a stuck collective ever hits it."""
        c = self.config.cluster
        horizon = (c.acceptable_pause_ms + 10 * c.heartbeat_ms) / 1000
        step = 10 * (self.timer.slot_s or 0) * self.config.train.slots
        return timedelta(seconds=max(c.min_collective_timeout_ms / 1000, 2 * horizon, step))

    def _transfer(self, ep: Epoch) -> None:
        """State at the epoch's start: every replica lost, a checkpoint or the seed;
        else a live replica's state to those that lack it, and each member's own shard
        of the optimizer state (``member/transfer.py``)."""
        tr = self.trainer
        assert tr is not None
        if ep.start.recover:
            self._reload(ep.start.reload)
        elif self.transfer.copy(ep, tr):
            self.has_state = True
        shards, scatters = self.shards, self.config.train.scatters
        if shards is not None:
            self.transfer.then(ep, lambda: self.transfer.exchange_shards(ep, tr, shards, scatters))

    def _shard_group(self, store: dist.Store, comm: Comm, rank: int) -> None:
        """This epoch's replica group (``train.shard_degree`` > 1): its process group and
        the trainer's side of it."""
        assert self.trainer is not None
        k = self.config.train.shard_degree
        if k == 1:
            return
        train, tr = self.config.train, self.trainer
        group = comm.subgroup(store, f"shard{group_of(rank, k)}", shard_of(rank, k), k)
        params = optimizer_params(tr.optimizer)
        module = tr.module if train.shard_params else None
        layout = tr.engine.params if train.scatters else None
        self.shards = Shards(
            params,
            k=k,
            rank=rank,
            group=group,
            timeout=self._timeout(),
            module=module,
            layout=layout,
            prefetch=train.shard_prefetch,
        )
        tr.shards = self.shards
        if train.scatters:
            self.shards.build_scatter(comm, store, comm.size, tr.layout.numel, tr.layout.size)
        if train.shard_reduce == "scatter" and self.shards.why_whole:
            log.warning(
                "%s: train.shard_reduce: whole, not scatter: %s", self.name, self.shards.why_whole
            )

    def _new_trainer(self) -> Trainer:
        """The replica built from the seed (step 0)."""
        config = self.config
        trainer = Trainer(
            config,
            cache_dir=str(self.run_dir / "cache"),
            poison=_schedule(config, POISON_PART),
            placement=self.placement,
            corrupt=_schedule(config, CORRUPT_PART),
        )
        trainer.loader.read_delay_s = self.chaos.storage_delay_s  # the slow_storage fault
        return trainer

    def _reload(self, path: str | None) -> None:
        """Every replica was lost: start again from a checkpoint, or from the seed when the
        run has none (a replica past step 0, torn or not, is built again: every member
        then holds the same step-0 state)."""
        assert self.trainer is not None
        if path is not None:
            self._load(path)
        elif self.trainer.next_step != 0 or self.has_state:
            self.trainer.close()
            self.trainer = self._new_trainer()
            self.salvage.clear()
        self.has_state = True

    def _load(self, path: str) -> None:
        """Restore a checkpoint. One of another config hash loads only if the launcher
        allowed it; the override then becomes a decision-log entry (the launcher logs the
        event once), the same on every replica."""
        assert self.trainer is not None
        keys = self.trainer.load(path, allow_config_change=self.allow_config_change)
        if keys:
            lazy = open_lazy(path)  # its step and hash (no tensor read)
            lazy.reader.close()
            self.trainer.decisions.append(
                config_override_entry(lazy.loaded, self.trainer.config_hash, keys)
            )

    def _close_epoch(self, ep: Epoch) -> None:
        ep.runner.close_flight()  # an overlapped outer step: settled, or undone
        self.transfer.settle(ep)  # a copy served before the epoch ended: its event
        ep.comm.close()
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        if self.trainer is not None:
            self._log_gathers(ep)
            self.trainer.shards = None
            self.trainer.gather = None  # the parameters stay at rest: ``held`` says which
        if ep.ckpt is not None:
            saves.close_writer(ep.ckpt, self.events, self.name)

    def _log_gathers(self, ep: Epoch) -> None:
        gather = self.trainer.gather if self.trainer is not None else None
        if gather is None:
            return
        self.events.write(
            {
                "event": ev.PARAMS_PEAK,
                "worker": self.name,
                "epoch": ep.number,
                "peak_bytes": gather.peak_bytes,
                "of": sum(gather.nbytes),
                "gathers": gather.gathers,
                "prefetched": gather.prefetched,
                "largest_unit_bytes": gather.largest_unit,
            }
        )

    def _steps(self, ep: Epoch) -> None:
        assert self.trainer is not None
        while self.trainer.next_step < self.client.last_step(self.config.train.steps):
            t = self.trainer.next_step
            self.inflight = t
            if self._should_stop(t):
                return
            # The step's admission: its metrics line and its update belong to this
            # generation only if the fence still allows it when the step begins.
            self.fence.check(ep.generation, f"step {t}")
            self._step(ep, t)
        ep.runner.open_gate()  # a copy still served (no step ran): before the final save's
        self._finish(ep)

    def _step(self, ep: Epoch, t: int) -> None:
        """One step: ``step.train_step`` (the flow, top to bottom), with this worker's
        side of its end (the checkpoint snapshot before the update, then the commit)."""
        assert ep.ckpt is not None and self.trainer is not None
        saves.check_saves(ep.ckpt, self.name)
        end = StepEnd(
            before_update=ep.ckpt.wait_snapshot,
            after_update=lambda t, loss, step_s: self._commit(ep, t, loss, step_s),
        )
        if self.transfer.pace(ep, self.trainer, t):  # a paced copy's part (copy_pacing)
            self.has_state = True
        train_step(ep.runner, t, end)
        self._log_repairs()

    def _log_repairs(self) -> None:
        """A ``part_repaired`` event for each part the data store served after a failed
        read (read again, or a mirror's copy) since the last step."""
        if self.trainer is None:
            return
        for record in self.trainer.take_repairs():
            log.warning("%s: part %s repaired via %s", self.name, record["part"], record["via"])
            self.events.write({"event": ev.PART_REPAIRED, "worker": self.name, **record})

    def _line(self, ep: Epoch, t: int, loss: float, step_s: float) -> None:
        assert self.trainer is not None
        self.metrics.write(step_line(self.trainer, self.config, ep, t, loss, step_s, self.name))

    def _commit(self, ep: Epoch, t: int, loss: float | None, step_s: float) -> None:
        """After step ``t``'s update: its metrics line (an overlapped outer step's once
        its reduction is in: ``StepRunner.settle``), a due evaluation, the replicas'
        fingerprints every ``fingerprint_every`` steps, and a due checkpoint's save (an
        overlapped outer step's reduction settled first: the checkpoint holds its mean)."""
        tr = self.trainer
        assert tr is not None
        if loss is not None:
            self._line(ep, t, loss, step_s)
        partial = ep.runner.partial  # a paced copy's receivers: they evaluate nothing
        writer = min(r for r in range(ep.size) if r not in partial)
        if ep.rank not in partial:
            self.evaluation.after(tr, t, self.metrics.write if ep.rank == writer else _drop)
        every = self.config.cluster.fingerprint_every
        if ep.size > 1 and tr.next_step % every == 0 and not ep.runner.compare_fingerprints():
            self.has_state = False  # receive a live peer's state in the next epoch
            raise CommFailed(f"replica diverged at step {tr.next_step}")
        if saves.due(self.config, tr.next_step, self.client.last_step(self.config.train.steps)):
            ep.runner.settle()
            saves.save_due(tr, ep, self.config, self.name)

    def _finish(self, ep: Epoch) -> None:
        """The final checkpoint (all members write it in parallel), then report done."""
        tr = self.trainer
        assert tr is not None and ep.ckpt is not None
        ep.runner.settle()  # an overlapped outer step's reduction: in the final state
        self._flush(ep, tr.next_step - 1)
        every = self.config.cluster.fingerprint_every
        if ep.size > 1 and tr.next_step % every and not ep.runner.compare_fingerprints():
            self.has_state = False  # no run ends with replicas that disagree
            raise CommFailed(f"replica diverged at step {tr.next_step}")
        # Sharded, the state to save is a collective of each group, on every member, as
        # is the digest after it. The save is a collective too (its commit waits for every
        # member's part), so all members save if any has not saved this step: a member
        # that received the state at the last step has not, while its peers have.
        state = tr.checkpoint_state(saves.topology(self.config, ep))
        if ep.runner.any_member(self.final_saved != tr.next_step):
            saves.save_final(tr, ep, state, self.name)
            self.final_saved = tr.next_step
        self.client.send(p.Done(next_step=tr.next_step, final_hash=tr.digest(state.optimizer)))

    def _flush(self, ep: Epoch, t: int) -> None:
        """A paced copy not complete at the run's end (a drain asked for before its last
        part), whose final save and hash need every member's whole state: its parts
        left, now (``StateTransfer.flush``)."""
        assert self.trainer is not None
        if self.transfer.flush(ep, self.trainer, t):
            self.has_state = True

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            client=self.client,
            chaos=self.chaos,
            fence=self.fence,
            events=self.events,
            name=self.name,
            region=self.region,
            interval_s=self.config.cluster.heartbeat_ms / 1000,
            store=self._store,
            trainer=lambda: self.trainer,
            slot_s=lambda: self.timer.slot_s,
            fenced=self._fenced,
        )


class RunEndWatch:
    """Whether the run's merged event log shows its end (or failure) since this was
    made; once true, true for good. Read only while the worker has no coordinator."""

    def __init__(self, path: Path) -> None:
        self.tail = Tail(path, from_end=True)
        self.over = False

    def __call__(self) -> bool:
        if not self.over:
            ends = (ev.RUN_END, ev.RUN_FAILED)
            self.over = any(e.get("event") in ends for e in self.tail.read())
        return self.over


def _drop(line: dict[str, Any]) -> None:
    """A member other than rank 0 writes no evaluation line."""


def _schedule(config: RunConfig, kind: str) -> list[tuple[int, int]]:
    """``(part, step)`` of the schedule's faults of a data kind that every loader applies
    at exactly its step (``poison_part``, ``corrupt_part``)."""
    return [(int(f.target), int(f.at_step or 0)) for f in config.chaos.faults if f.kind == kind]
