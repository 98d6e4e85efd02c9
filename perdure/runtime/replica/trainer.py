"""One replica: model, optimizer, data loader and the math of a step, minus the network.

Everything here is a pure function of (config, dataset version, decision log, step), so
every replica, and a single process replaying the run, computes the same bits.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from perdure import events as ev
from perdure.chaos.faults.corrupt_part import CORRUPT_PART
from perdure.chaos.faults.poison_part import POISON_PART
from perdure.checkpoint import (
    CheckpointState,
    capture_rng,
    check_compatible,
    load_checkpoint,
    restore_rng,
    state_digest,
)
from perdure.checkpoint.ranges import Lazy, open_lazy
from perdure.checkpoint.tensors import MODEL, byte_view, flatten, to_cpu_contiguous
from perdure.data import DataError, Dataset, DataState, SlotLoader
from perdure.data.retry import ReadPolicy
from perdure.provenance import provenance
from perdure.run_config import RunConfig, canonical, config_hash, dataset_path, resolve_path
from perdure.runtime.replica.deferred import (
    SeedInit,
    at_rest,
    free,
    make_resident,
    renew,
    resident,
    resident_bytes,
)
from perdure.runtime.replica.identity import run_identity
from perdure.runtime.replica.layout import BAD, OVERFLOW, GradLayout
from perdure.runtime.replica.loss_scale import (
    BACKED_OFF,
    GREW,
    LOSS_SCALE_KEY,
    LossScale,
    ScaleRule,
    scale_event,
)
from perdure.runtime.replica.outer import OUTER_KEY, OuterStep
from perdure.runtime.replica.param_gather import ParamGather
from perdure.runtime.replica.pending import FromCheckpoint, FromSeed, Pending
from perdure.runtime.replica.placement import Placement, determinism, deterministic_cuda
from perdure.runtime.replica.recipe import Recipe
from perdure.runtime.replica.slots import Progress, SlotEngine, all_finite, to_tensors
from perdure.runtime.replica.task import Task, build_task, plain_module
from perdure.runtime.shard_plan import ALL, NONE

FINITE, NON_FINITE, WITHHELD = 0, 1, 2
"""A sample's rerun verdict (:meth:`Trainer.rerun_flags`): small integers, summed exactly
by any reduction, so every member reads the same verdict."""

REDUCTION_KEY = "reduction"
"""Beside the recipe's state in a checkpoint's optimizer field: the reduction's carried
state (``{"exponents": ...}``): a list of integers, one per bucket, with
``train.reduction_exponents = "carried"``; an int32 tensor, one per block, with
``"streamed"``; absent otherwise."""


class MathError(RuntimeError):
    """The math of the run went non-finite in a way no data can explain (a non-finite
    update from a finite gradient, or every slot of a step non-finite): every replica hits
    it identically, so it stops the run instead of quarantining data."""


def configure_torch(threads: int, device: str = "cpu") -> None:
    """Fix what changes bits: intra-op threads and deterministic algorithms (on CUDA also
    cuBLAS's workspace, TF32 and cuDNN: ``placement.deterministic_cuda``, before the first
    CUDA call)."""
    torch.set_num_threads(threads)
    if device == "cuda":
        deterministic_cuda()
    torch.use_deterministic_algorithms(True)


class ShardSeam(Protocol):
    """What the trainer needs of its replica group (``runtime/member/shard_group.py``)."""

    mine: int

    @property
    def shard_params(self) -> bool: ...

    def gatherer(self) -> ParamGather: ...

    @property
    def scattered(self) -> bool: ...

    @property
    def own_range(self) -> tuple[int, int] | None: ...

    def clip(self, params: Sequence[torch.Tensor], max_norm: float | None) -> float: ...

    def drop_foreign_grads(self) -> None: ...

    def sync_params(self) -> None: ...

    def owned_params(self, j: int) -> list[torch.Tensor]: ...

    def skeleton(self, state: dict[str, Any]) -> dict[str, Any]: ...

    def fetcher(self, whole: dict[str, Any]) -> Callable[[str, torch.Tensor], torch.Tensor]: ...

    def holders(self, state: dict[str, Any], world: int) -> dict[str, tuple[int, ...]]: ...


class Trainer:
    """A replica's state and its step math."""

    def __init__(
        self,
        config: RunConfig,
        *,
        cache_dir: str | None = None,
        poison: Sequence[tuple[int, int]] = (),
        placement: Placement | None = None,
        corrupt: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.config = config
        train = config.train
        self.placement = placement or Placement.of(train, config.cluster)
        configure_torch(train.threads_per_worker, train.device)
        task = build_task(config.task, train.seed, config.run.base_dir)
        self.pending: Pending | None = self._initial(task)
        """Sharded at rest (``train.shard_params``) before this replica knows its shard:
        where its parameters, all at rest, come from (``replica/pending.py``)."""
        # Built on the CPU from the seed (the same initial bits wherever it runs), then moved:
        # the optimizer, built next, holds the moved parameters.
        task.model.to(self.placement.device)
        self.model = task.model
        self.task = task  # its eval_fn: the worker's evaluation (runtime/member/evaluate.py)
        self.module = plain_module(task.model)
        """What checkpoints, state copies and fingerprints read: the plain module's keys."""
        outer = config.outer
        inner_steps = train.steps * outer.inner_steps if outer.on else train.steps
        self.recipe = Recipe(task, config.optim, inner_steps)
        self.optimizer = self.recipe.optimizer
        mean = task.loss_reduction == "mean"
        self.engine = SlotEngine(
            self.model,
            task.loss_fn,
            train.seed,
            train.slots,
            mean_loss=mean,
            precision=train.precision,
            buffers=self.placement.buffers,
            metrics=tuple(task.metrics),
        )
        data = config.data
        self.dataset = Dataset.open(
            dataset_path(config),
            cache_dir=data.cache_dir or cache_dir,
            cache_mb=data.cache_mb,
            mirrors=tuple(resolve_path(config, m) for m in data.mirrors),
            policy=ReadPolicy(attempts=data.read_attempts, timeout_s=data.read_timeout_s),
        )
        self.loader = SlotLoader(
            self.dataset,
            seed=train.seed,
            global_batch=train.global_batch,
            slots=train.slots,
            prefetch_steps=data.prefetch_steps,
            document_fields=data.document_fields,
            on_corrupt=data.on_corrupt,
        )
        self.outer: OuterStep | None = None
        """DiLoCo (``outer.replicas``): a slot is a virtual replica's inner steps and the
        update is the outer step (``replica/outer.py``)."""
        if outer.on:
            self.outer = OuterStep(
                outer,
                self.engine,
                self.recipe,
                self.loader.batch,
                global_batch=train.global_batch,
                grad_clip=config.optim.grad_clip,
                prefetch=lambda step, slot: self.prefetch(step, range(slot, slot + 1), inner=True),
            )
        carried = train.reduction == "exact" and train.reduction_exponents != "step"
        self._keep_replicas = outer.on and carried and outer.precision == "fp32"
        """DiLoCo with exponents carried from the previous step: a member keeps its
        replicas of the step in flight (``OuterStep.replica``), so the pass that a missed
        prediction repeats, and a step redone in a new epoch, copy them (the step form
        and the chain keep each slot's buffer already: ``runtime/replica/salvage.py``, and so does
        int8's gather, whatever the exponents' form)."""
        self.poison = sorted(poison)
        self.corrupt = sorted(corrupt)
        """Chaos: ``(part, step)``: the part's primary copy reads corrupt from that step."""
        for kind, part in [(POISON_PART, k) for k, _ in poison] + [
            (CORRUPT_PART, k) for k, _ in corrupt
        ]:
            if not 0 <= part < self.dataset.num_parts:
                raise ValueError(
                    f"chaos.faults: {kind} target must be a part of {config.data.dataset} "
                    f"in [0, {self.dataset.num_parts}) (got {part})"
                )
        self.decisions: list[dict[str, Any]] = []
        self.next_step = 0
        self.shards: ShardSeam | None = None
        """This member's replica group in the current epoch (``train.shard_degree`` > 1)."""
        self.torn = False
        """This replica must receive a peer's state before it trains again: a sharded
        update that did not complete (a group member died during the parameters'
        exchange: its own shard moved on, the others did not), or a state copy that began
        writing into its model tensors (in place, range by range: :meth:`copy_target`)
        and did not complete. A member behind its peers whose copy failed halfway reported
        its old state before, and a coordinator that lost every holder with the copy could
        have taken that mixture of two states as the run's. Loading a state clears it."""
        self.partial = False
        """A receiver of a paced state copy between its first and its last part
        (``runtime/member/copy_pacing.py``): the tensors of the parts still to come are
        not the run's. It fingerprints as holding nothing, exports nothing, and reports
        no state; the last part, or loading a state, clears it."""
        self.held = ALL
        """Which shard's optimizer state this replica holds (``shard_plan.ALL``: all), and
        with ``train.shard_params`` which shard's parameters are resident."""
        self.gather: ParamGather | None = None
        """With ``train.shard_params``, in an epoch: the parameters at rest, gathered while
        a slot runs (``runtime/replica/param_gather.py``)."""
        self._whole = False
        self.exponents: list[int] | torch.Tensor | None = None
        """The exact reduction's carried exponents for the next step: one per bucket
        (``train.reduction_exponents = "carried"``) or an int32 tensor of one per block
        (``"streamed"``); None until a step has measured them. State of the run, in
        checkpoints and state copies."""
        self._staged: list[int] | torch.Tensor | None = None
        self._undo_step: tuple[int, int] | None = None
        """``(next_step, state_version)`` before :meth:`apply_pending` (:meth:`undo_outer`)."""
        self.state_version = 0
        """Changes with every change of the state a slot's gradient depends on (an update,
        received or restored state, a quarantine): the key of salvaged slot buffers."""
        self.scale_rule = ScaleRule.of(train)
        rule = self.scale_rule
        self.loss_scale: LossScale | None = None if rule is None else rule.initial()
        """The loss scale's committed state (``train.precision = "fp16"``, else None):
        state of the run, changed only by an update (``apply``), in checkpoints and state
        copies beside the optimizer's (``loss_scale.LOSS_SCALE_KEY``)."""
        self._scale_now = self.loss_scale
        """The scale of the step in flight: the committed one, backed off by the step's
        overflows (``back_off``); ``begin_step`` returns to the committed one."""
        self.scale_changes: list[dict[str, Any]] = []
        """The step in flight's scale changes (``loss_scale`` events), kept until its update
        commits them (``take_scale_changes``): a step abandoned and redone logs them once."""
        self.step_loss_scale: float | None = None
        """The scale the last applied step's gradient was computed at. Logged."""
        self._set_engine_scale()
        self.user_metrics: dict[str, float] = {}
        """The last applied step's ``Task.metrics`` by name (means over the batch)."""
        self.grad_norm: float | None = None
        """The last applied step's gradient norm (2-norm over every parameter's reduced,
        mean gradient), taken before ``optim.grad_clip`` scales it: what
        ``clip_grad_norm_`` returns; computed without a clip too. Logged, not state."""
        self._pending_optim: dict[str, Any] | None = None
        """With a checkpoint pending: its optimizer state, every tensor a ``meta``
        stand-in that ``_lazy`` reads by byte range once the shard that needs it is known."""
        self._lazy: Lazy | None = None
        """The pending checkpoint, opened without its tensors (``checkpoint/ranges.py``)."""
        self.ckpt_read_bytes: int | None = None
        """Sharded at rest and loaded from a checkpoint: the tensor bytes this rank read
        from it (its shard's, the buffers, and any shard it sent meanwhile)."""
        self.peak_param_bytes = 0
        """The most parameter bytes this replica has held at once outside a slot's
        gathers (building the model, loading, filling its shard)."""
        self._note_peak()
        identity = run_identity(task, self.recipe.initial, self.dataset.version_id)
        self.config_hash = config_hash(config, identity)
        self.canonical = canonical(config, identity)
        self.provenance = {
            **provenance(config.task.entry),
            "determinism": determinism(self.placement),
        }

    def _initial(self, task: Task) -> Pending | None:
        """The initial parameters: eager (built whole by the factory), or per module
        (``task.init``): every module's made now, or with ``train.shard_params`` none
        until the replica knows its shard (a pending seed)."""
        if self.config.task.init != "per_module":
            return None
        at_rest(task.model, self.placement.device)
        seeded = SeedInit(task.model, seed=self.config.train.seed, init=task.init)
        if self.config.train.shard_params:
            return FromSeed(seeded)
        seeded.fill(list(task.model.parameters()))
        return None

    def _note_peak(self, seen: int = 0) -> None:
        """``peak_param_bytes`` with what is resident now, and ``seen``: a peak that a
        pending source measured while it filled."""
        held = resident_bytes(self.module.parameters())
        self.peak_param_bytes = max(self.peak_param_bytes, held, seen)

    # -- the math of a step ----------------------------------------------------------------

    @property
    def layout(self) -> GradLayout:
        """The slot buffers' layout (what the step runner and the reducer see)."""
        return self.engine.layout

    @property
    def computes_in_place(self) -> bool:
        """Whether computing a step's slots writes, for a while, state a checkpoint holds
        (and puts it back after): DiLoCo's inner steps move the parameters, a slot's
        forward moves the tracked buffers (BatchNorm's running statistics, restored after
        each slot, ``replica/buffers.py``). A checkpoint snapshot still copying must be
        done before such a step computes, not only before its update: a clean-clone CI
        saw a DiLoCo checkpoint hold parameters one inner step on."""
        return self.outer is not None or self.engine.buffers.numel > 0

    @property
    def tokens_per_step(self) -> int:
        """Tokens a step reads: with DiLoCo an outer step's, ``outer.inner_steps`` x B."""
        inner = self.config.outer.inner_steps if self.outer is not None else 1
        return inner * self.config.train.global_batch * self.dataset.seq_len

    def poison_due(self, step: int) -> None:
        """Fault injection: parts poisoned from a given step on (identically everywhere),
        and parts whose primary copy reads corrupt from a given step on (once each)."""
        for part, at in self.poison:
            if step >= at:
                self.loader.poison_part(part)
        while self.corrupt and step >= self.corrupt[0][1]:
            part, _ = self.corrupt.pop(0)
            self.loader.corrupt_part(part)

    def compute_slots(
        self,
        step: int,
        slots: Sequence[int],
        bufs: Sequence[torch.Tensor],
        should_abort: Callable[[], bool] = lambda: False,
        ready: Progress | None = None,
    ) -> bool:
        """Fill ``bufs`` with the gradients of ``slots`` of ``step``; False if aborted.
        ``ready`` follows the last slot's buffer as its backward fills it."""
        for i, (buf, slot) in enumerate(zip(bufs, slots, strict=True)):
            if should_abort():
                return False
            last = i == len(bufs) - 1
            if self.outer is not None:  # a virtual replica's inner steps (DiLoCo)
                key = (step, self.state_version) if self._keep_replicas else None
                part = ready if last else None
                if not self.outer.replica(step, slot, buf, should_abort, part, key):
                    return False
                continue
            batch = to_tensors(self.loader.batch(step, slot))
            with self._gathered():
                self.engine.compute(step, slot, batch, buf, ready=ready if last else None)
        return True

    def _gathered(self) -> contextlib.AbstractContextManager[None]:
        """Around a slot: the parameters gathered as used (sharded at rest only)."""
        if self.gather is None or self._whole:
            return contextlib.nullcontext()
        return self.gather.active(self.model)

    @contextlib.contextmanager
    def params_whole(self) -> Iterator[None]:
        """Every parameter resident inside (sharded at rest: gathered, a collective of the
        group, then freed again): for what runs on some ranks only, such as re-running a
        non-finite slot. The whole parameters are held meanwhile."""
        gather = self.gather
        if gather is None:
            yield
            return
        try:
            gather.gather_many(range(len(gather.params)))  # one broadcast per owner
            self._whole = True
            yield
        finally:
            self._whole = False
            gather.release()

    def warm_up(self) -> None:
        """One throwaway slot gradient (step 0, slot 0), for a replica that will receive
        its state. A process's first slot opens and verifies parts and allocates what later
        calls reuse (~1.3-1.5x a warm one here); a joiner or spare should pay that while it
        waits, not in its first step as a member, where every member waits for it.

        The bits are unaffected: every slot reseeds the RNG and starts from cleared
        gradients, and the data quarantine that the read could add on this replica alone
        (an unreadable part) is replaced by the received one (``adopt``)."""
        if self.pending is not None:
            return  # its parameters are at rest until it knows its shard: nothing to run
        try:
            batch = to_tensors(self.loader.batch(0, 0))
        except DataError:  # a part with no good copy: the steps that need it report it
            return
        self.engine.compute(0, 0, batch, self.engine.new_buffer())

    def prefetch(self, step: int, slots: Sequence[int], *, inner: bool = False) -> None:
        """Read ``step``'s samples of ``slots`` in the background (with DiLoCo, an outer
        step's first inner step, unless ``inner``: ``step`` is an inner step's)."""
        if self.outer is not None and not inner:
            step *= self.config.outer.inner_steps
        if self.config.data.prefetch_steps:
            self.loader.prefetch(step, list(slots))

    # -- the loss scale (fp16) ------------------------------------------------------------

    def _set_engine_scale(self) -> None:
        self.engine.scale = None if self._scale_now is None else self._scale_now.scale

    def begin_step(self) -> None:
        """A step's first attempt (in this epoch): at the committed scale. Where an
        abandoned attempt had backed it off, the slots it kept were computed at another
        scale: ``state_version`` moves on, so they are not reused."""
        if self._scale_now != self.loss_scale:
            self.state_version += 1
        self._scale_now, self.scale_changes = self.loss_scale, []
        self._set_engine_scale()

    def back_off(self, step: int, slots: list[int]) -> None:
        """``slots`` of ``step`` overflowed (confirmed on a re-run): the smaller scale, for
        the step's next attempt. At ``train.loss_scale_min`` a :class:`MathError`."""
        now, rule = self._scale_now, self.scale_rule
        assert now is not None and rule is not None, "an overflow without a loss scale"
        new = now.backed_off(rule)
        if new is None:
            raise MathError(
                f"step {step}: the gradient of slots {slots} overflows float16 at the minimum "
                f"loss scale (train.loss_scale_min = {rule.min_scale!r}) with a finite loss: "
                "the gradient itself exceeds float16's range (use train.precision = 'bf16' "
                "or 'fp32', or lower train.loss_scale_min)"
            )
        self.scale_changes.append(scale_event(step, now.scale, new.scale, BACKED_OFF, slots))
        self._scale_now = new
        self.state_version += 1  # the slots' gradients depend on it
        self._set_engine_scale()

    def take_scale_changes(self) -> list[dict[str, Any]]:
        """The applied step's scale changes (each a ``loss_scale`` event's fields)."""
        out, self.scale_changes = self.scale_changes, []
        return out

    def _commit_scale(self, step: int) -> None:
        """After ``step``'s update: one more clean step, a growth when due."""
        now, rule = self._scale_now, self.scale_rule
        if now is None or rule is None:
            return
        new = now.applied(rule)
        if new.scale != now.scale:
            self.scale_changes.append(scale_event(step, now.scale, new.scale, GREW, []))
        self.loss_scale = self._scale_now = new
        self._set_engine_scale()

    # -- the update -------------------------------------------------------------------------

    def apply(self, step: int, total: torch.Tensor) -> float:
        """Apply the slot-ordered gradient sum of ``step``; returns the step's mean loss.
        With DiLoCo, ``total`` is the sum of the replicas' pseudo-gradients and the update
        the outer step; the loss is the inner steps' mean over every replica. Under a loss
        scale S the gradient sum is divided by ``B * S`` at once (S a power of two: the
        product is exact, and one rounding is what dividing by S, exactly, and then by B
        gives wherever the quotient by S is a normal float)."""
        B = self.config.train.global_batch
        loss = float(self.engine.slot_losses(total).sum()) / B
        self.user_metrics = self.engine.step_metrics(total, B)
        if self.outer is not None:
            self.outer.apply(total)
            self.grad_norm = self.outer.norm
            self._check_update(step, self.config.outer.lr)
            return self._committed(step, loss)
        own = None if self.shards is None else self.shards.own_range
        scale = None if self._scale_now is None else self._scale_now.scale
        self.step_loss_scale = scale
        self.engine.assign_grads(total, B if scale is None else B * scale, own)
        self.engine.apply_buffers(total)
        clip = self.config.optim.grad_clip
        if self.shards is not None and self.shards.scattered:  # own gradients only
            self.grad_norm = self.shards.clip(list(self.model.parameters()), clip)
        elif clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=False)
            self.grad_norm = float(norm)
        else:  # the same arithmetic as the clip's, without the scaling
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
            self.grad_norm = float(norm) if norm is not None else 0.0
        lr = self.recipe.set_lr(step)
        synced = self.shards is not None and self.gather is None
        if self.shards is not None:
            self.shards.drop_foreign_grads()
            self.torn = synced  # until every owner's update is in: see ``torn``
        self.recipe.step()
        if self.shards is not None and synced:  # sharded at rest: nobody else keeps them
            self.shards.sync_params()
            self.torn = False
        self._check_update(step, lr)
        return self._committed(step, loss)

    # -- the overlapped outer step (outer.delay = 1, ``runtime/step.py``) -------------------

    def apply_pending(self, step: int) -> None:
        """Outer step ``step``'s update under ``outer.delay = 1`` before its own reduction
        is done: the pending mean (step ``step - 1``'s) moves the parameters, as
        :meth:`apply` would move them, and ``step`` is committed as far as the next
        replicas are concerned (``next_step``, ``state_version``). Its sum arrives with
        :meth:`settle_outer`; a reduction lost before then is :meth:`undo_outer`'s."""
        assert self.outer is not None
        self._undo_step = (self.next_step, self.state_version)  # the version: a record only
        self.outer.apply_pending()
        self.grad_norm = self.outer.norm
        self._check_update(step, self.config.outer.lr)
        self._committed(step, 0.0)

    def settle_outer(self, step: int, total: torch.Tensor) -> float:
        """Outer step ``step``'s reduced sum, in after :meth:`apply_pending`: its mean is
        now the pending one; returns the step's loss (the replicas' mean inner loss) and
        sets its ``user_metrics``, as :meth:`apply` does from the same sum."""
        assert self.outer is not None
        B = self.config.train.global_batch
        loss = float(self.engine.slot_losses(total).sum()) / B
        self.user_metrics = self.engine.step_metrics(total, B)
        self.outer.settle(total)
        self._undo_step = None
        return loss

    def undo_outer(self) -> int:
        """The reduction of the step :meth:`apply_pending` applied was lost: the state as
        it was before (parameters, outer momentum, pending mean, ``next_step``), under a
        new ``state_version`` (a version is never reused: the caller keeps its replicas
        of the step under the new one). Returns the step, to be redone."""
        assert self.outer is not None and self._undo_step is not None
        self.outer.undo()
        self.next_step = self._undo_step[0]
        self.state_version += 1
        self._undo_step = None
        return self.next_step

    def _check_update(self, step: int, lr: float) -> None:
        """Parameters that the update made non-finite stop the run (a ``MathError``). Not
        on a paced copy's partial receiver: the tensors of its parts still to come are not
        the run's (a failed copy's renewed storages hold whatever memory held), and every
        member that is whole checks the same update."""
        if self.partial:
            return
        if not self._params_finite():
            raise MathError(
                f"step {step}: the optimizer made parameters non-finite from a finite gradient "
                f"(lr at this step {lr:g}; check optim.lr, optim.weight_decay, optim.eps, "
                "outer.lr and the model's own arithmetic)"
            )

    def _committed(self, step: int, loss: float) -> float:
        """The update of ``step`` is in: the next step's state."""
        self.next_step = step + 1
        self.state_version += 1
        self._commit_scale(step)
        if self._staged is not None:  # the next step's exponents come with this update
            self.exponents, self._staged = self._staged, None
        return loss

    def stage_exponents(self, exponents: list[int] | torch.Tensor) -> None:
        """The carried exponents this step's gradient gives the next one (``apply`` makes
        them current with its update; an abandoned step leaves them unused)."""
        self._staged = exponents

    def _params_finite(self) -> bool:
        """One sum per parameter and one read of the sums (see ``slots.all_finite``); the
        resident ones only (sharded at rest, each shard's owners check it)."""
        sums = [p.detach().sum() for p in self.model.parameters() if resident(p)]
        return not sums or all_finite(torch.stack(sums))

    def rerun_flags(self, step: int, slot: int) -> list[int]:
        """Re-run each sample of a slot alone: which ones give a non-finite gradient?
        Per sample :data:`FINITE`, :data:`NON_FINITE`, or :data:`WITHHELD` (its part has
        no good copy in the store: the sample was never served, so the data's storage is
        at fault, not the data, the worker or the model)."""
        batch = self.loader.batch(step, slot)
        buf = self.engine.new_buffer()
        flags = []
        withheld = set(batch.bad_parts)
        for i in range(len(batch.sample_ids)):
            if int(batch.parts[i]) in withheld:
                flags.append(WITHHELD)
                continue
            one = to_tensors(_row(batch, i))
            self.engine.compute(step, slot, one, buf)
            flags.append(NON_FINITE if self.layout.flags(buf)[slot] == BAD else FINITE)
        return flags

    def rerun_overflows(self, step: int, slot: int) -> bool:
        """Re-run a slot flagged as an overflow, whole, at the step's scale: does it
        overflow here too? (A slot's bits are the same on every worker: an overflow that
        does not reproduce is a fault of the worker that reported it.)"""
        buf = self.engine.new_buffer()
        self.engine.compute(step, slot, to_tensors(self.loader.batch(step, slot)), buf)
        return bool(self.layout.flags(buf)[slot] == OVERFLOW)

    def quarantine(self, step: int, found: dict[int, list[int]]) -> list[dict[str, Any]]:
        """Quarantine the parts of the bad samples of several slots at once: a
        ``corrupt`` entry for parts whose samples were withheld (no good copy), a
        ``quarantine`` entry for samples whose gradient is non-finite; returns them.

        ``found`` maps a slot to its per-sample rerun flags (:meth:`rerun_flags`, the same
        on every member). All batches are read before the quarantine takes effect:
        afterwards the same positions hold resampled data.
        """
        hits: dict[int, tuple[set[int], set[int]]] = {NON_FINITE: (set(), set()),
                                                      WITHHELD: (set(), set())}  # fmt: skip
        for slot, flags in found.items():
            batch = self.loader.batch(step, slot)
            for sid, part, flag in zip(batch.sample_ids, batch.parts, flags, strict=True):
                if flag in hits:
                    hits[flag][0].add(int(part))
                    hits[flag][1].add(int(sid))
        slots = sorted(found)
        entries = []
        parts, samples = hits[WITHHELD]
        if parts:
            self._check_left(step, parts)
            why = self.dataset.store.bad_parts()
            named = "; ".join(f"part {k}: {why.get(k, 'no good copy')}" for k in sorted(parts))
            reason = f"no good copy (data.on_corrupt = 'quarantine'): {named}"
            entries.append(self._quarantined(step, "corrupt", (parts, samples), slots, reason))
        parts, samples = hits[NON_FINITE]
        if parts:
            reason = f"non-finite gradient in slots {slots}, reproduced on rerun"
            entries.append(self._quarantined(step, "quarantine", (parts, samples), slots, reason))
        return entries

    def _quarantined(
        self, step: int, kind: str, hit: tuple[set[int], set[int]], slots: list[int], reason: str
    ) -> dict[str, Any]:
        parts, samples = hit
        self.loader.quarantine(sorted(parts), step, reason)
        self.state_version += 1
        entry = {
            "step": step,
            "kind": kind,
            "parts": sorted(parts),
            "samples": sorted(samples),
            "slots": slots,
            "reason": reason,
        }
        self.decisions.append(entry)
        return entry

    def _check_left(self, step: int, corrupt: set[int]) -> None:
        """Quarantining ``corrupt`` must leave a part to train on; else the run stops."""
        active = self.loader.quarantine_list.active(step)
        gone = {int(k) for k in active.parts} | corrupt
        if len(gone) >= self.dataset.num_parts:
            store = self.dataset.store
            why = store.bad_parts()
            named = "; ".join(
                f"{store.url(k)}: {why.get(k, 'no good copy')}" for k in sorted(corrupt)
            )
            raise DataError(
                f"step {step}: parts {sorted(corrupt)} have no good copy ({named}), and "
                "quarantining them (data.on_corrupt = 'quarantine') leaves no part to train "
                "on: run `perdure data verify DATASET`, restore the parts or set "
                "data.mirrors, and resume from the last checkpoint"
            )

    def take_repairs(self) -> list[dict[str, Any]]:
        """Parts the data store repaired since the last call (``part_repaired`` events)."""
        return self.dataset.store.take_repairs()

    # -- state -----------------------------------------------------------------------------

    def fingerprint(self) -> list[int]:
        """A CRC per tensor of the model's state (parameters and buffers, in state-dict
        order: see ``fingerprint_names``), compared across replicas every K steps; -1 for a
        parameter this rank does not hold (sharded at rest)."""
        partial = self.partial  # a paced copy's receiver holds nothing it can vouch for
        return [
            zlib.crc32(byte_view(to_cpu_contiguous(t)))  # not .numpy(): see ``byte_view``
            if resident(t) and not partial
            else -1
            for t in self.module.state_dict().values()
        ]

    def fingerprint_names(self) -> list[str]:
        return list(self.module.state_dict().keys())

    def digest(self, optimizer: dict[str, Any] | None = None) -> str:
        """The state digest of the whole replica. Sharded, the other shards' tensors stream
        through the group one at a time (every member of the group must call it at the
        same point): the same digest as the unsharded replica's, without its memory.
        ``optimizer``: the optimizer state of a ``checkpoint_state`` just taken (its
        skeleton, when sharded), so that it is not asked of the group twice."""
        model = self._model_state()
        whole = self._optimizer_for_save() if optimizer is None else optimizer
        if self.shards is None:
            return state_digest(model, whole)
        return state_digest(model, whole, fetch=self.shards.fetcher(whole))

    def keep_shard(
        self, state: dict[str, Any] | None, params: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Hold exactly this shard's optimizer state from now on (``Shards.exchange``)
        and, sharded at rest, its parameters only (``params``: those it received)."""
        assert self.shards is not None
        if self.pending is not None:  # every shard virtually: make its own real
            assert not params, "a pending replica holds every shard and receives none"
            self.pending.fill(self.shards.owned_params(self.shards.mine))
            self._note_peak(self.pending.peak_bytes)
            if self._lazy is not None and state is not None:
                state = self._lazy.resolve(state)  # this shard's tensors only
            self._drop_pending()
        if state is not None:
            self.recipe.load_state_dict(state, source="the replica group's shard")
        self._copy_in(params or {})
        self.held = self.shards.mine
        if self.shards.shard_params:
            self.gather = self.shards.gatherer()

    def whole_optimizer(self) -> dict[str, Any]:
        """The optimizer state a shard is cut from: a pending checkpoint's, else the
        recipe's (``Shards.exchange``)."""
        if self._pending_optim is not None:
            return self._pending_optim
        return self.recipe.state_dict()

    def _drop_pending(self) -> None:
        """The pending source is used up (or replaced): forget it, close its files."""
        if self._lazy is not None:
            self.ckpt_read_bytes = self._lazy.reader.bytes_read
            self._lazy.reader.close()
        self.pending, self._pending_optim, self._lazy = None, None, None

    def _fill_optimizer(self, params: Sequence[torch.Tensor]) -> list[tuple[dict, str, Any]]:
        """A pending checkpoint's optimizer state of ``params`` read in place (their
        stand-ins replaced); returns what to put back."""
        if self._lazy is None or self._pending_optim is None:
            return []
        order = [p for g in self.recipe.optimizer.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        states = self._pending_optim["state"]
        undo = []
        for p in params:
            s = states.get(index[id(p)])
            for k, v in (s or {}).items():
                if isinstance(v, torch.Tensor) and self._lazy.key_of(v) is not None:
                    undo.append((s, k, v))
        got = self._lazy.reader.read_many(dict.fromkeys(self._lazy.keys[id(v)] for *_, v in undo))
        for s, k, v in undo:
            s[k] = got[self._lazy.keys[id(v)]]
        return undo

    @contextlib.contextmanager
    def filled(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """``params`` resident inside, for a pending replica that sends a shard it does not
        keep (made from its source, then at rest again), with their optimizer state."""
        if self.pending is None:
            yield
            return
        self.pending.fill(params)
        self._note_peak(self.pending.peak_bytes)
        undo = self._fill_optimizer(params)
        try:
            yield
        finally:
            for s, k, v in undo:
                s[k] = v
            for p in params:
                free(p)

    def _copy_in(self, model: dict[str, torch.Tensor]) -> None:
        """Copy tensors of the model's state in by name, making each resident first (a
        parameter at rest has no storage)."""
        named = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, t in model.items():
                dst = named[name]
                make_resident(dst)
                dst.copy_(t)
        self._note_peak()

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict, a parameter this rank does not hold (sharded at rest)
        as a ``meta`` tensor of its dtype and shape (``save_holders`` names who has it)."""
        return {
            n: t if resident(t) else torch.empty(t.shape, dtype=t.dtype, device="meta")
            for n, t in self.module.state_dict().items()
        }

    def checkpoint_state(self, topology: dict[str, Any]) -> CheckpointState:
        """The seven fields. Sharded, the optimizer state is this rank's shard plus the
        other shards as ``meta`` tensors (``save_holders`` says who writes them): every
        member of the group must call it at the same point."""
        return CheckpointState(
            step=self.next_step,
            model=self._model_state(),
            optimizer=self._optimizer_for_save(),
            rng=capture_rng(self.config.train.seed),
            data=self.loader.state(self.next_step).to_dict(),
            config_hash=self.config_hash,
            canonical_config=self.canonical,
            topology=topology,
            provenance=self.provenance,
            decisions=list(self.decisions),
        )

    def _optimizer_state(self) -> dict[str, Any]:
        """The recipe's state, with the carried exponents beside it (if any): what a
        checkpoint and a state copy hold alike."""
        state = self.recipe.state_dict()
        exps = self.exponents
        if exps is not None:
            kept = exps.clone() if isinstance(exps, torch.Tensor) else list(exps)
            state = {**state, REDUCTION_KEY: {"exponents": kept}}
        if self.outer is not None:
            state = {**state, OUTER_KEY: self.outer.state()}
        if self.loss_scale is not None:
            state = {**state, LOSS_SCALE_KEY: self.loss_scale.to_dict()}
        return state

    def _optimizer_for_save(self) -> dict[str, Any]:
        state = self._optimizer_state()
        return state if self.shards is None else self.shards.skeleton(state)

    def _load_optimizer(self, state: dict[str, Any], source: str) -> None:
        """The recipe's state, and the carried exponents and the loss scale saved beside
        it (if any)."""
        state = dict(state)
        self._load_scale(state.pop(LOSS_SCALE_KEY, None), source)
        reduction = state.pop(REDUCTION_KEY, None)
        exps = None if reduction is None else reduction.get("exponents")
        self.exponents, self._staged = self._checked_exponents(exps, source), None
        outer = state.pop(OUTER_KEY, None)
        if self.outer is not None:
            self.outer.load(outer, source)
        self.recipe.load_state_dict(state, source=source)

    def _load_scale(self, saved: Any, source: str) -> None:
        """The loss scale saved with the state; none saved (a state of a run without
        ``fp16``, loaded with a config change): the initial one."""
        rule = self.scale_rule
        if rule is None:
            return
        got = rule.initial() if saved is None else LossScale.from_dict(saved, rule, source)
        self.loss_scale = self._scale_now = got
        self.scale_changes = []
        self._set_engine_scale()

    def _checked_exponents(self, exps: Any, source: str) -> list[int] | torch.Tensor | None:
        form = self.config.train.reduction_exponents
        if exps is None or form == "step":
            return None
        if form == "streamed":
            ok = isinstance(exps, torch.Tensor) and exps.dtype == torch.int32 and exps.dim() == 1
            if not ok:
                raise ValueError(
                    f"{source}: optimizer.{REDUCTION_KEY}.exponents must be a 1-d int32 tensor, "
                    "one per block of the gradient buffer (train.reduction_exponents = "
                    f"'streamed'; got {type(exps).__name__})"
                )
            return exps.clone()
        listed = isinstance(exps, list) and bool(exps) and all(type(e) is int for e in exps)
        if not listed or not all(-(1 << 10) <= e <= 1 << 10 for e in exps):
            raise ValueError(
                f"{source}: optimizer.{REDUCTION_KEY}.exponents must be a list of integers "
                f"in [-1024, 1024], one per bucket of the gradient buffer (got {exps!r:.80})"
            )
        return exps

    def save_holders(self, state: CheckpointState, world: int) -> dict[str, tuple[int, ...]]:
        """Which ranks of a ``world``-member epoch hold each tensor of ``state`` that not
        all of them hold (none when the state is whole on every rank)."""
        return {} if self.shards is None else self.shards.holders(state.optimizer, world)

    def load(self, path: str | Path, *, allow_config_change: bool = False) -> list[str]:
        """Restore all seven fields from a checkpoint; returns any override records.
        Sharded at rest, the checkpoint is opened without its tensors and each is read
        later by byte range (``_load_pending``): this rank never reads the whole model."""
        lazy = open_lazy(path) if self.config.train.shard_params else None
        ckpt = (
            load_checkpoint(path, verify=self.config.checkpoint.verify_on_load)
            if lazy is None
            else lazy.loaded
        )
        notes = check_compatible(
            ckpt,
            self.config_hash,
            self.canonical,
            allow_config_change=allow_config_change,
            provenance=self.provenance,
        )
        self.gather = None
        self._drop_pending()
        if lazy is not None:
            self._load_pending(lazy, str(path))
        else:
            self.module.load_state_dict(ckpt.model)
            self._load_optimizer(ckpt.optimizer, str(path))
            self._note_peak()
        restore_rng(ckpt.rng)
        self.next_step = self.loader.restore(DataState.from_dict(ckpt.data, source=str(path)))
        self.decisions = list(ckpt.decisions)
        self.held = ALL
        self.torn = self.partial = False
        self._undo_step = None
        self.state_version += 1
        assert self.next_step == ckpt.step, (self.next_step, ckpt.step)
        return notes

    def _load_pending(self, lazy: Lazy, path: str) -> None:
        """Sharded at rest: the checkpoint's buffers now, its parameters and optimizer state
        by shard once the replica knows its own (``keep_shard``), each tensor read then
        from its byte ranges; every parameter at rest meanwhile. Names, shapes and dtypes
        are checked here, so a checkpoint of another model is refused now, naming the
        tensor."""
        ckpt = lazy.loaded
        named = self.module.state_dict(keep_vars=True)
        _check_model(named, ckpt.model, path)
        params = {id(p) for p in self.module.parameters()}
        with torch.no_grad():
            for name, t in named.items():
                if id(t) not in params:
                    t.copy_(lazy.reader.read(MODEL + name))  # a buffer: whole on every rank
        for p in self.module.parameters():
            free(p)
        state = dict(ckpt.optimizer)
        self._load_scale(lazy.resolve(state.pop(LOSS_SCALE_KEY, None)), path)
        reduction = lazy.resolve(state.pop(REDUCTION_KEY, None))
        exps = None if reduction is None else reduction.get("exponents")
        self.exponents, self._staged = self._checked_exponents(exps, path), None
        # the param groups and the scheduler now (checked); each shard's tensors later
        rest = lazy.resolve({k: v for k, v in state.items() if k != "state"})
        self.recipe.load_state_dict({**rest, "state": {}}, source=path)
        self._pending_optim = state
        self._lazy = lazy
        self.pending = FromCheckpoint(self.module, lazy)

    def export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """What a joiner needs: model, optimizer, and the JSON extras. Sharded at rest,
        the model's tensors this rank holds (its shard's parameters and the buffers)."""
        assert not self.partial, "a paced copy's receiver exported its partial state"
        extra = {
            "next_step": self.next_step,
            "data": self.loader.state(self.next_step).to_dict(),
            "decisions": self.decisions,
            "held": NONE if self.pending is not None else self.held,  # none of it real yet
        }
        model = {n: t for n, t in self.module.state_dict().items() if resident(t)}
        return model, self._optimizer_state(), extra

    def adopt(
        self, model: dict[str, torch.Tensor], optim: dict[str, Any], extra: dict[str, Any]
    ) -> None:
        if self.config.train.shard_params:  # a shard's parameters (``export``), or all
            self._copy_in(model)  # into parameters that may be at rest (no storage)
        else:
            self.module.load_state_dict(model)
        self._load_optimizer(optim, "the received state")
        self.loader.restore(DataState.from_dict(extra["data"]))
        self.decisions = [ev.renamed_decision(d) for d in extra["decisions"]]
        self.next_step = int(extra["next_step"])
        self.held = int(extra.get("held", ALL))
        self._drop_pending()
        self.torn = self.partial = False
        self._undo_step = None
        self.state_version += 1

    def copy_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The model state dict's names, shapes and dtypes (a state copy's offers are
        checked against it; a parameter at rest keeps its shape)."""
        named = self.module.state_dict(keep_vars=True)
        return {n: (tuple(t.shape), t.dtype) for n, t in named.items()}

    def copy_target(
        self, device: torch.device, *, zeroed: bool = False
    ) -> Callable[..., torch.Tensor]:
        """Where a state copy writes each tensor it receives: the model's own tensors
        (made resident: sharded at rest, those of the shard received), fresh optimizer
        tensors on ``device`` (the group's, as a received state's always were); ``adopt``
        then takes them as they are. The first model tensor handed out tears the replica
        (:attr:`torn`) until ``adopt``.

        On a replica already torn, each model tensor gets a fresh storage first (once per
        tensor: a weight tied under two names is one), the old one left to whoever holds
        it: a copy that failed may still have receives on the wire into it until they
        time out (:func:`~perdure.runtime.replica.param_gather.renew`), and their bytes
        landing after this copy's checksums would change a parameter unseen. Not while an
        epoch's parameter gather holds the parameters' own storages
        (``train.shard_params``; it is built after the epoch's copy and dropped with the
        epoch). Limit: a model tensor that is a view of another's storage (parameters
        flattened into one buffer by the task) stops sharing it there.

        ``zeroed``: fresh optimizer tensors and renewed model tensors are zeros (a paced
        copy's first part: the state of the parts still to come is updated as it is until
        they come, and undefined memory may hold bits that make the update non-finite)."""
        named = self.module.state_dict(keep_vars=True)
        stale = self.torn and self.gather is None  # written by a copy that did not complete
        renewed: set[int] = set()

        def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if key.startswith(MODEL):
                self.torn = True
                t = named[key[len(MODEL) :]]
                if stale and id(t) not in renewed:
                    renewed.add(id(t))
                    renew(t)
                    if zeroed:  # a paced copy's later parts update it until they come
                        t.detach().zero_()
                make_resident(t)
                return t.detach()
            if zeroed:
                return torch.zeros(shape, dtype=dtype, device=device)
            return torch.empty(shape, dtype=dtype, device=device)

        return target

    def part_target(self) -> Callable[..., torch.Tensor]:
        """Where a paced copy's later part writes each tensor: the model's own and the
        optimizer's live ones, in place (the first part built their structure). The
        replica is torn while a part is on its way (see :meth:`copy_target`)."""
        named = self.module.state_dict(keep_vars=True)
        live, _ = flatten({}, self._optimizer_state())

        def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t = named.get(key[len(MODEL) :]) if key.startswith(MODEL) else live.get(key)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"paced state copy: {key} ({dtype} {list(shape)}) is not in this "
                    "replica's state as its first part built it"
                )
            if key.startswith(MODEL):
                self.torn = True
            return t.detach()

        return target

    def close(self) -> None:
        self._drop_pending()  # a checkpoint still pending: its files
        self.loader.close()


def _check_model(named: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], path: str) -> None:
    """A checkpoint's model tensors against the module's: the same names, shapes and
    dtypes (what ``load_state_dict`` checks, before any tensor is read)."""
    missing, unexpected = sorted(set(named) - set(saved)), sorted(set(saved) - set(named))
    if missing or unexpected:
        raise ValueError(
            f"{path}: the model's tensors do not match the task's model (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]})"
        )
    for name, t in named.items():
        s = saved[name]
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(
                f"{path}: model/{name} is {s.dtype} {list(s.shape)}, the task's model "
                f"has {t.dtype} {list(t.shape)}"
            )


def _row(batch: Any, i: int) -> Any:
    class _One:
        tokens = None if batch.tokens is None else batch.tokens[i : i + 1]
        weight = batch.weight[i : i + 1]
        fields = {k: v[i : i + 1] for k, v in getattr(batch, "fields", {}).items()}  # noqa: RUF012

    return _One()
