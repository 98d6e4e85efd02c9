"""A state copy paced over steps (``cluster.copy_step_mb``): a copy longer than one step
costs the run no more than one step, whatever the state's size.

The overlapped copy (``copy_overlap.py``) hides a copy behind the epoch's first step only
as far as that step's compute goes: the holders' gate before its reduction waits for the
rest (a 1.2 TB state at link rate is an hour). Paced, the state is cut into *parts*,
each a run of whole parameters with their optimizer state (and the first part the model's
other tensors, the optimizer's other tensors and the JSON extras), of at most
``copy_step_mb`` each, and part ``j`` travels in step ``s + j`` (``s``: the epoch's start
step):

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
a parameter and its optimizer state travel in one part (a unit, :func:`parts`), which is
why a part is whole parameters, not byte ranges. Where the optimizer's state of one
parameter depended on another's (none of torch's do), the paced copy would be wrong; the
receivers' first full step's fingerprint comparison would say so.

Every step of the window ``[s, s + n)`` is planned with no slot on a receiver (the
first step's idle plan, ``plan.idle_plan``); from ``s + n`` on the receivers compute their
share. Until its last part is in, a receiver is *partial* (``Trainer.partial``): its
fingerprint holds nothing (-1s), a non-finite slot is re-run on another member, and it
reports no state to the coordinator (an epoch that ends in the window copies it again,
whole); a checkpoint due in the window is written by the others (its share of the
tensors too: ``saves.holders``) and an evaluation by the lowest rank that is whole. The
run's end, whose final save and hash need every member's whole state, *flushes* the copy
first where it comes before the last part (a drain): the parts left, all at once,
blocking, from the holders' state after that step.

All members derive the same parts: a holder from its own export, a receiver from the
template's offer (the swarm copy's ``select``), both by :func:`parts` over the same keys
and sizes; a template whose parts differ from a holder's own ends the copy
(``StateCopyFailed``). The number of parts is capped by the steps the run has left
(``train.steps``, the same on every member), so the last part lands before its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from perdure.checkpoint.tensors import MODEL, OPTIMIZER
from perdure.runtime.comm.swarm import StateCopyFailed

STATE = OPTIMIZER + "state/"


def param_units(
    module: torch.nn.Module, groups: Iterable[Iterable[torch.Tensor]]
) -> dict[str, int]:
    """Each parameter's state-dict names (a tied weight has several) -> its index in the
    optimizer's order (``groups``: its param groups' params, the order its state dict
    numbers them); a parameter the optimizer does not hold (frozen) a unit of its own
    after those, in the model's order. Buffers have none: the first part's."""
    index = {id(p): i for i, p in enumerate(p for g in groups for p in g)}
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


def parts(
    sizes: Sequence[tuple[str, int]], units: Mapping[str, int], budget: int, most: int
) -> list[frozenset[str]]:
    """The state's keys (``sizes``: key and bytes, in the state's order) cut into parts of
    at most ``budget`` bytes, whole units each (a unit larger than the budget alone), in
    the optimizer's order of the parameters; the first part also holds every key of no
    unit. At most ``most`` parts (the steps left): the tail joins the last one. A pure
    function."""
    if budget < 1 or most < 1:
        raise ValueError(f"parts: budget and most must be >= 1 (got {budget}, {most})")
    loose: list[str] = []
    grouped: dict[int, list[str]] = {}
    nbytes: dict[int, int] = {}
    for key, n in sizes:
        u = unit_of(key, units)
        if u is None:
            loose.append(key)
            continue
        grouped.setdefault(u, []).append(key)
        nbytes[u] = nbytes.get(u, 0) + n
    out: list[list[str]] = [list(loose)]
    used = sum(n for k, n in sizes if k in set(loose))
    for u in sorted(grouped):
        if used > 0 and used + nbytes[u] > budget:
            out.append([])
            used = 0
        out[-1] += grouped[u]
        used += nbytes[u]
    if len(out) > most:
        out[most - 1 :] = [[k for part in out[most - 1 :] for k in part]]
    return [frozenset(p) for p in out]


@dataclass
class Pacing:
    """One member's view of the epoch's paced copy: its parts (set once, by the holder's
    own export or the template's offer) and how far it went."""

    start: int
    """The epoch's start step: part 0's."""
    units: Mapping[str, int]
    budget: int
    most: int
    parts: list[frozenset[str]] | None = None
    sent: int = 0
    """The parts moved so far (their steps' gates passed, or received)."""
    flushed: int | None = None
    """The step whose commit flushed the copy, if one did."""

    def derive(self, sizes: Sequence[tuple[str, int]]) -> list[frozenset[str]]:
        """The parts of a state of these keys and sizes; a second call must agree."""
        got = parts(sizes, self.units, self.budget, self.most)
        if self.parts is not None and got != self.parts:
            raise StateCopyFailed(
                f"paced state copy: the template's parts ({len(got)}) differ from this "
                f"member's own ({len(self.parts)})"
            )
        self.parts = got
        return got

    def select(self, part: int) -> Callable[[Sequence[tuple[str, int]]], frozenset[str]]:
        """The swarm copy's ``select`` for part ``part``: the keys it moves, from the
        template's offer."""
        return lambda sizes: self.derive(sizes)[part]

    def rest(self) -> Callable[[Sequence[tuple[str, int]]], frozenset[str]]:
        """``select`` of a flush: every part not moved yet."""
        return lambda sizes: frozenset().union(*self.derive(sizes)[self.sent :])

    @property
    def count(self) -> int:
        assert self.parts is not None
        return len(self.parts)

    @property
    def end(self) -> int:
        """The first step whose plan gives the receivers slots again."""
        if self.flushed is not None:
            return self.flushed + 1
        return self.start + self.count

    def part_at(self, step: int) -> int | None:
        """The part step ``step`` moves, if any (part 0 moves at the epoch's start)."""
        if self.flushed is not None or self.parts is None:
            return None
        j = step - self.start
        return j if 0 < j < self.count else None

    @property
    def complete(self) -> bool:
        return self.parts is not None and self.sent >= len(self.parts)
