"""A state copy paced over steps (``cluster.copy_pace``): a copy longer than one step
costs the run no more than one step, whatever the state's size.

The overlapped copy (``copy_overlap.py``) hides a copy behind the epoch's first step only
as far as that step's compute goes: the holders' gate before its reduction waits for the
rest (a 1.2 TB state at link rate is an hour). Paced, the state moves in *parts*, each a
run of whole parameters with their optimizer state (the first part also the model's other
tensors, the optimizer's other tensors and the JSON extras), one part a step, part ``j``
in step ``s + j`` (``s``: the epoch's start step):

- a *holder* serves part ``j`` from its committed state (after step ``s + j - 1``) on the
  server thread while it computes step ``s + j``, and passes its gate before that step's
  reduction once the part is served: only the update writes the state, after the gate;
- a *receiver* receives part ``j`` (blocking: it has no slot), then takes part in step
  ``s + j``'s reduction with no slot and applies the step's update to every tensor it
  holds, so the parts it received before stay at the holders' version, and the tensors
  of the parts still to come are written over when they arrive. The first part's extras
  (step, data offsets, decision log) are step ``s - 1``'s, and the receiver's own updates
  move them on as every member's do.

The receiver's update of a tensor needs that tensor's optimizer state at the same version:
a parameter and its optimizer state travel in one part (a *group*, :func:`groups`), which
is why a part is whole parameters, not byte ranges. Where the optimizer's state of one
parameter depended on another's (none of torch's do), the paced copy would be wrong; the
receivers' first full step's fingerprint comparison would say so.

*How big a part is.* The template (the copy's source) names each part's budget in its
offer (``PACE_KEY`` in its extras, checked as a peer's input), and every member takes the
same groups from the same point (:func:`take`): the agreement costs no message beyond the
offers each part exchanges anyway. ``copy_pace = "fixed"``: ``copy_step_mb`` a part.
``"auto"``: the first part ``copy_step_mb`` (small states: the whole copy, as overlapped),
each later one what the source measured the copy to move in the time it computes a step
(its last part's bytes over its seconds, times its slots' time, times ``FILL``). A step
left to the run's end takes every group left, so the last part lands before it.

Every step until the last part is in is planned with no slot on a receiver (the first
step's idle plan, ``plan.idle_plan``; ``StepRunner.first_until``); from the step after it
the receivers compute their share. Until then a receiver is *partial*
(``Trainer.partial``): its fingerprint holds nothing (-1s), a non-finite slot is re-run on
another member, and it reports no state to the coordinator (an epoch that ends in the
window copies it again, whole); a checkpoint due in the window is written by the others
(its share of the tensors too: ``saves.holders``) and an evaluation by the lowest rank
that is whole. The run's end, whose final save and hash need every member's whole state,
*flushes* the copy first where it comes before the last part (a drain): the groups left,
all at once, blocking, from the holders' state after that step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from perdure.checkpoint.tensors import MODEL, OPTIMIZER
from perdure.runtime.comm.swarm import StateCopyFailed

STATE = OPTIMIZER + "state/"


def param_units(
    module: torch.nn.Module, param_groups: Iterable[Iterable[torch.Tensor]]
) -> dict[str, int]:
    """Each parameter's state-dict names (a tied weight has several) -> its index in the
    optimizer's order (``param_groups``: its groups' params, the order its state dict
    numbers them); a parameter the optimizer does not hold (frozen) a unit of its own
    after those, in the model's order. Buffers have none: the first part's."""
    index = {id(p): i for i, p in enumerate(p for g in param_groups for p in g)}
    for p in module.parameters():
        index.setdefault(id(p), len(index))
    named = module.state_dict(keep_vars=True)
    return {n: index[id(t)] for n, t in named.items() if id(t) in index}


def unit_of(key: str, units: Mapping[str, int]) -> int | None:
    """The parameter a flattened state key belongs to (``model/NAME`` of a parameter, or
    ``optimizer/state/I/...``), or None: the first part's (buffers, other optimizer
    tensors)."""
    if key.startswith(MODEL):
        return units.get(key[len(MODEL) :])
    if key.startswith(STATE):
        head = key[len(STATE) :].split("/", 1)[0]
        return int(head) if head.isdigit() else None
    return None


PACE_KEY = "pace_bytes"
"""The template's budget for the part it offers, bytes (in its offer's extras)."""

FILL = 0.8
"""The share of a step's compute an automatic part is sized to fill."""

Group = tuple[tuple[str, ...], int]


def groups(sizes: Sequence[tuple[str, int]], units: Mapping[str, int]) -> list[Group]:
    """The state's keys (``sizes``: key and bytes, in the state's order) in the order the
    parts take them, with their bytes: first every key of no unit (one group, possibly
    empty), then each unit's keys, by unit index. A pure function."""
    grouped: dict[int | None, list[str]] = {None: []}  # None: the keys of no unit
    nbytes: dict[int | None, int] = {None: 0}
    for key, n in sizes:
        u = unit_of(key, units)
        grouped.setdefault(u, []).append(key)
        nbytes[u] = nbytes.get(u, 0) + n
    order = [None, *sorted(u for u in grouped if u is not None)]
    return [(tuple(grouped[u]), nbytes[u]) for u in order]


def take(gs: Sequence[Group], start: int, budget: int) -> int:
    """The end of the part that starts at group ``start``: the groups up to ``budget``
    bytes, at least one (a group larger than the budget alone). A pure function."""
    end, used = start, 0
    while end < len(gs) and (end == start or used + gs[end][1] <= budget):
        used += gs[end][1]
        end += 1
    return end


def budget_of(extra: Mapping[str, object]) -> int:
    """The template's budget for its part: a peer's input, checked."""
    b = extra.get(PACE_KEY)
    if not isinstance(b, int) or isinstance(b, bool) or b < 1:
        raise StateCopyFailed(
            f"paced state copy: the template's {PACE_KEY} must be an int >= 1 (got {b!r})"
        )
    return b


def auto_budget(nbytes: int, seconds: float, compute_s: float | None) -> int | None:
    """An automatic part's bytes: what the last part's rate (``nbytes`` in ``seconds``)
    moves in ``FILL`` of the source's compute of a step (``compute_s``); None where
    either is not measured."""
    if compute_s is None or compute_s <= 0 or seconds <= 0 or nbytes <= 0:
        return None
    return max(1, int(nbytes / seconds * compute_s * FILL))


@dataclass
class Pacing:
    """One member's view of the epoch's paced copy: how far it went (every member
    advances through the same groups, after each part is in)."""

    start: int
    """The epoch's start step: part 0's."""
    units: Mapping[str, int]
    done: int = 0
    """Groups moved (their parts' gates passed, or received)."""
    total: int | None = None
    """Groups in all (the first part's template tells)."""
    parts: int = 0
    """Parts moved."""
    flushed: int | None = None
    """The step whose end flushed the copy, if one did."""
    moving: tuple[int, int] = (0, 0)
    """The part in flight: its end group and its bytes (set by its ``select``)."""
    last: tuple[int, float] | None = None
    """A holder's last part served: its bytes and seconds (the next automatic part's
    rate)."""

    def select(
        self, rest: bool = False
    ) -> Callable[[Sequence[tuple[str, int]], Mapping[str, object]], frozenset[str]]:
        """The swarm copy's ``select`` for the next part (``rest``: every group left):
        from the template's keys, sizes and budget. The same on every call of one copy."""

        def pick(sizes: Sequence[tuple[str, int]], extra: Mapping[str, object]) -> frozenset[str]:
            gs = groups(sizes, self.units)
            if self.total is None:
                self.total = len(gs)
            elif self.total != len(gs):
                raise StateCopyFailed(
                    f"paced state copy: the template's state has {len(gs)} groups, the "
                    f"first part's had {self.total}"
                )
            end = len(gs) if rest else take(gs, self.done, budget_of(extra))
            self.moving = (end, sum(n for _, n in gs[self.done : end]))
            return frozenset(k for keys, _ in gs[self.done : end] for k in keys)

        return pick

    def whole_in_one(self, sizes: Sequence[tuple[str, int]], extra: Mapping[str, object]) -> bool:
        """Whether the first part of a state of these keys and sizes, at this budget, is
        the whole state (a holder's own view before its copy starts: the receivers then
        get their slots from the next step on, as with the overlapped copy; every holder
        of a replica offers the same structure and the same first budget)."""
        gs = groups(sizes, self.units)
        return take(gs, 0, budget_of(extra)) == len(gs)

    def advance(self) -> None:
        """The part in flight is in."""
        self.done = self.moving[0]
        self.parts += 1

    @property
    def complete(self) -> bool:
        return self.total is not None and self.done >= self.total
