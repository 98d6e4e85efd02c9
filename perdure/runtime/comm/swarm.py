"""Swarm state copy: a receiver fetches disjoint byte ranges of the state from every live
holder at once, straight into its own tensors, each range checked against its sender's
XXH3-64.

Every member of the epoch calls :meth:`SwarmCopy.copy` (holders and receivers alike: it is
a sequence of collectives over the epoch's group):

1. *Offers.* Each holder's structure (its exported tensors' key, shape and dtype, the
   optimizer's tagged JSON, the extras) is sent to every rank as JSON (point to point:
   gloo's all-gather cost ms here), in one exchange where it fits a fixed-size head
   (``HEAD_BYTES``); a receiver offers nothing. Only this small structure
   goes through the codec, never a tensor's bytes.
2. *Plan*, the same on every rank: a pure function of the offers, the receivers and the
   model's layout (every rank builds the same model from the same config). A receiver
   copies one holder's offer, its *template*: the designated source's, or, with replica
   groups (``train.shard_degree`` > 1), the lowest holder that holds the receiver's own
   shard, so that a joiner fetches only its shard. Each template tensor is cut into
   ``chunk_bytes`` ranges; each range is asked first of the holder, among those that
   offer the same tensor (key, shape, dtype) at the same step, with the fewest bytes
   assigned so far: disjoint ranges from every holder in parallel, balanced by bytes.
3. *Transfer.* A holder sends views of its own tensors (no staging on the CPU, where the
   group's tensors live; a chunk-sized staging copy each otherwise) followed by the
   range's XXH3-64; a receiver receives into views of its own tensors (the model's own
   parameters, made resident first) and checks the checksum. Small ranges of one
   receiver asked of one holder travel together (``bundle_bytes``: one staging buffer on
   each end, one checksum; a bundle that fails it fails all its ranges). Each rank keeps
   at most ``window`` messages in flight, all ranks post in one global order (receiver,
   first range), so no cycle of waits can form; a source's extra memory is at most
   ``window`` chunks (only bundles on the CPU) whatever the state's size.
4. *Verdict.* The receivers' failed ranges go to every rank; each is fetched again from
   the next holder that offers it. A range that failed from every such holder ends the
   copy with :class:`StateCopyFailed` on every rank (a data-plane fault: the epoch ends,
   the coordinator plans again), never a crash.

Limits: an offer is JSON a peer sent, so it is checked before it is used (types, dtypes,
shapes, sizes, the model's names, shapes and dtypes against this rank's own model; an
offer that fails makes its holder ineligible on every rank alike, a template that fails
refuses the copy); the bytes of a range are trusted to the backend's framing (gloo and
NCCL match a receive's size to the send's, and every rank derives both sizes from the
same plan); XXH3-64 catches corruption, not a forger. A non-contiguous source tensor is
made contiguous once, whole. Each message is two sends (its bytes, its checksum).
``Shards.exchange`` moves a shard with it too; there a
rank that holds nothing of the shard passes no offer and takes part in the collectives
only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections import deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import xxhash

from perdure.checkpoint.tensors import (
    DTYPES,
    ITEMSIZE,
    MODEL,
    TORCH_DTYPES,
    byte_view,
    flatten,
    model_of,
    unflatten_optimizer,
)
from perdure.runtime.comm.group import Comm, CommFailed
from perdure.runtime.shard_plan import shard_of

CHUNK_BYTES = 4 << 20
"""Bytes per range: large enough that a range's two messages cost little beside its
bytes, small enough that ``WINDOW`` of them in flight spread over every holder."""

WINDOW = 12
"""Messages in flight per rank: at most ``WINDOW * CHUNK_BYTES`` (48 MiB) of staging on a
source whose tensors are not where the group's are, ``WINDOW * BUNDLE_BYTES`` (12 MiB) of
bundles (below) on either end."""

BUNDLE_BYTES = 1 << 20
"""The largest bundle: consecutive ranges of at most a quarter of this, all of one
receiver and asked of one holder, travel as one message (one staging copy on each end,
one checksum). A replica's biases, norms and AdamW's 4-byte steps are hundreds of tiny
tensors; one message each cost a copy of a 1.8 MB state 113 ranges, ~0.05-0.08 s of
Python beside a holder's compute (docs/performance.md, section 17). 0 sends every range
alone."""

MESSAGE_COST = 4096
"""What a range costs a holder beyond its bytes, in bytes, when ranges are balanced."""

MAX_OFFER_BYTES = 64 << 20
"""The largest structure a holder may offer (JSON of names, shapes and the optimizer's
structure: kilobytes for the models here, megabytes for thousands of tensors)."""

OPTIMIZER_FACTOR = 8
"""An offer's optimizer tensors may hold at most this many times the model's bytes (AdamW
holds 2x; a bound on what a peer can make a receiver allocate, not a check of the math)."""

State = tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]
Target = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


class StateCopyFailed(CommFailed):
    """The state copy could not complete: no holder offers a usable structure, or a range
    failed its checksum from every holder that offers it. A data-plane fault: the worker
    reports it and the coordinator plans a new epoch."""


@dataclass(frozen=True, kw_only=True)
class CopyJob:
    """One epoch's state copy, as one member sees it."""

    receivers: tuple[int, ...]
    """The ranks that receive (joiners, members behind), in rank order."""
    source: int
    """The coordinator's designated source: the template of an unsharded copy."""
    shard_degree: int
    """``train.shard_degree``: with k > 1 a receiver copies a holder of its own shard."""
    layout: Layout
    """This rank's model state dict: name -> (shape, dtype) (the same on every rank)."""
    offer: State | None = None
    """A holder's exported state (``Trainer.export``); None on a receiver, and on a rank
    that takes no part but the collectives (it offers nothing)."""
    target: Target | None = None
    """A receiver's storage for a tensor (key, shape, dtype): its own model tensor, made
    resident, or a fresh optimizer tensor."""
    timeout: timedelta = timedelta(seconds=60)
    """Each operation's timeout (the epoch's collective timeout)."""
    select: Callable[[list[tuple[str, int]], dict[str, Any]], frozenset[str]] | None = None
    """The template's tensors this copy moves, from its keys and sizes in order and its
    extras (a paced copy's part, ``member/copy_pacing.py``); None: all. Every rank must
    derive the same keys from the same template. A receiver's storage is still asked for
    every tensor (``target``): the ones not moved keep what it holds."""


@dataclass
class Received:
    """What a receiver got: the state to adopt and how it came."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    extra: dict[str, Any]
    nbytes: int
    template: int
    """The rank whose structure it copied."""
    holders: list[int]
    """The ranks it received ranges from."""
    refetched: int
    """Ranges fetched again after a checksum mismatch."""


class StateCopy(Protocol):
    """The seam a member copies state through (``member/transfer.py``)."""

    stats: dict[str, int]
    """The last copy's counts on this member (``ranges_sent``, ``bytes_sent``, ...): a
    holder's ``state_sent`` event reports them."""

    def copy(self, comm: Comm, job: CopyJob) -> Received | None:
        """Every member calls it; a receiver returns its state, a holder None."""
        ...


@dataclass(frozen=True)
class Offer:
    """One holder's parsed, checked structure."""

    rank: int
    tensors: dict[str, tuple[tuple[int, ...], str]]
    """key -> (shape, dtype name), in the holder's order."""
    optimizer: Any
    extra: dict[str, Any]

    def nbytes(self, key: str) -> int:
        shape, dtype = self.tensors[key]
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        return n


@dataclass(frozen=True)
class Range:
    """Bytes [lo, hi) of tensor ``key``, range ``index`` of receiver ``dst``."""

    dst: int
    index: int
    key: str
    lo: int
    hi: int
    eligible: tuple[int, ...]
    """The holders that offer the tensor, in rank order."""
    first: int
    """The position in ``eligible`` of the holder asked first; attempt ``a`` asks the
    ``a``-th after it (each holder once)."""

    def holder(self, attempt: int) -> int | None:
        n = len(self.eligible)
        return self.eligible[(self.first + attempt) % n] if attempt < n else None


@dataclass
class SwarmCopy:
    """The swarm copy (see the module's docstring)."""

    chunk_bytes: int = CHUNK_BYTES
    window: int = WINDOW
    bundle_bytes: int = BUNDLE_BYTES
    stats: dict[str, int] = field(default_factory=dict)
    """Counters of the last copy on this rank (``ranges_sent``, ``bytes_sent``, ...)."""

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ValueError(f"SwarmCopy.chunk_bytes must be >= 1 (got {self.chunk_bytes})")
        if self.window < 1:
            raise ValueError(f"SwarmCopy.window must be >= 1 (got {self.window})")
        if self.bundle_bytes < 0:
            raise ValueError(f"SwarmCopy.bundle_bytes must be >= 0 (got {self.bundle_bytes})")

    def copy(self, comm: Comm, job: CopyJob) -> Received | None:
        me = comm.rank
        receiving = me in job.receivers
        if receiving and job.target is None:
            raise ValueError(f"rank {me}: a receiver must pass its storage (target)")
        tensors: dict[str, torch.Tensor] = {}
        raw = b""
        if job.offer is not None and not receiving:
            tensors, raw = self._encode(job.offer)

        raws = _exchange_bytes(comm, raw, job.timeout, frozenset(job.receivers))
        offers = _parse_all(raws, set(job.receivers))
        templates = {r: _template(r, job, offers) for r in job.receivers}
        # the template's keys this copy moves, once per template (a paced part's select)
        moved = {t: _moved(offers[t], job) for t in sorted(set(templates.values()))}
        ranges = _plan(job, offers, templates, self.chunk_bytes, moved)
        self.stats = {
            "ranges_sent": 0,
            "bytes_sent": 0,
            "messages_sent": 0,
            "ranges_received": 0,
            "messages_received": 0,
            "refetched": 0,
        }
        sink = _Sink(offers[templates[me]], job, moved[templates[me]]) if receiving else None
        attempts = {(r.dst, r.index): 0 for r in ranges}
        todo = ranges
        sources: set[int] = set()
        by_id = {(r.dst, r.index): r for r in ranges}
        while todo:
            ops = [(r, r.holder(attempts[(r.dst, r.index)])) for r in todo]
            mine = [(r, h) for r, h in ops if h == me or r.dst == me]
            sources |= {h for r, h in mine if r.dst == me and h is not None}
            round_ = functools.partial(self._round, comm, mine, tensors, sink, job)
            bad = comm.call(round_)
            failed = _exchange_failed(comm, bad, job.timeout, len(ranges), job.receivers)
            todo = []
            for dst, index in sorted(set(failed)):
                r = by_id.get((dst, index))
                if r is None:  # not a range of that rank's: nothing to fetch again
                    continue
                attempts[(dst, index)] += 1
                if r.holder(attempts[(dst, index)]) is None:
                    raise StateCopyFailed(
                        f"state copy: bytes [{r.lo}, {r.hi}) of {r.key} for rank {dst} failed "
                        f"their XXH3-64 from every holder that offers them ({list(r.eligible)})"
                    )
                todo.append(r)
            self.stats["refetched"] += len(todo)
        if sink is None:
            return None
        got = sink.received(templates[me], sorted(sources), self.stats["refetched"])
        return got

    # -- one round of ranges ----------------------------------------------------------------

    def _round(
        self,
        comm: Comm,
        ops: list[tuple[Range, int | None]],
        tensors: dict[str, torch.Tensor],
        sink: _Sink | None,
        job: CopyJob,
    ) -> list[int]:
        """Send and receive this rank's ranges, ``window`` messages in flight; the indices
        of the ranges received here whose checksum did not match."""
        pg, dev, t = comm.pg, comm.device, job.timeout
        flight: deque[tuple[list[Any], Callable[[], None]]] = deque()
        bad: list[int] = []
        source = _Source(tensors, dev)
        for msg in _messages(ops, self.bundle_bytes):
            first, h = msg[0]
            assert h is not None
            ranges = [r for r, _ in msg]
            tag = (2 * first.index) % (1 << 30)
            if h == comm.rank:
                data, check = source.message(ranges, self._outgoing)
                works = [pg.send([data], first.dst, tag), pg.send([check], first.dst, tag + 1)]
                self.stats["ranges_sent"] += len(ranges)
                self.stats["bytes_sent"] += sum(r.hi - r.lo for r in ranges)
                self.stats["messages_sent"] += 1
                flight.append((works, lambda: None))
            else:
                assert sink is not None
                buf, done = sink.message(ranges, dev, bad)
                check = torch.zeros(1, dtype=torch.int64, device=dev)
                works = [pg.recv([buf], h, tag), pg.recv([check], h, tag + 1)]
                self.stats["ranges_received"] += len(ranges)
                self.stats["messages_received"] += 1
                flight.append((works, functools.partial(_checked, done, check)))
            while len(flight) >= self.window:
                _finish(flight.popleft(), t)
        while flight:
            _finish(flight.popleft(), t)
        return bad

    def _encode(self, offer: State) -> tuple[dict[str, torch.Tensor], bytes]:
        """A holder's tensors by key and its offer's JSON (a seam for tests that offer a
        peer's malformed structure)."""
        return _encode_offer(*offer)

    def _outgoing(self, data: torch.Tensor) -> torch.Tensor:
        """The bytes sent for a range (a seam for tests that corrupt them on the wire)."""
        return data


def _messages(
    ops: list[tuple[Range, int | None]], bundle_bytes: int
) -> list[list[tuple[Range, int | None]]]:
    """This rank's ranges as messages, in the global order of each message's first range:
    a range above a quarter of ``bundle_bytes`` alone; smaller ones of one receiver asked
    of one holder gathered, in order, into bundles of at most ``bundle_bytes``. The two
    ends of a message see the same ranges of their pair in the same order, so they cut the
    same bundles; ordered by first range, every rank still posts in one global order, so
    no cycle of waits can form."""
    out: list[list[tuple[Range, int | None]]] = []
    open_: dict[tuple[int, int | None], tuple[list[tuple[Range, int | None]], int]] = {}
    small = bundle_bytes // 4
    for r, h in ops:
        n = r.hi - r.lo
        if n > small or bundle_bytes == 0:
            out.append([(r, h)])
            continue
        pair = (r.dst, h)
        msg, size = open_.get(pair, ([], bundle_bytes))
        if size + n > bundle_bytes:
            msg, size = [], 0
            out.append(msg)
        msg.append((r, h))
        open_[pair] = (msg, size + n)
    return out


def _checked(done: Callable[[int], None], check: torch.Tensor) -> None:
    done(int(check.item()))


def _finish(entry: tuple[list[Any], Callable[[], None]], timeout: timedelta) -> None:
    works, done = entry
    for w in works:
        w.wait(timeout)
    done()


def _checksum(data: torch.Tensor) -> int:
    """XXH3-64 of a range's bytes, as a signed 64-bit integer (what an int64 tensor
    carries). XXH3, not XXH3-64: on this machine 57 GB/s against zlib's 3.8, and with the
    sender's and the receiver's pass over every byte on the path, XXH3-64 alone held a
    loopback copy to a fifth of gloo's rate."""
    cpu = data if data.device.type == "cpu" else data.cpu()
    h = xxhash.xxh3_64_intdigest(byte_view(cpu))
    return h - (1 << 64) if h >= 1 << 63 else h


class _Source:
    """A holder's tensors as byte ranges: views where possible."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        self.tensors, self.device = tensors, device
        self._flat: tuple[str, torch.Tensor] | None = None

    def _bytes(self, key: str) -> torch.Tensor:
        if self._flat is None or self._flat[0] != key:
            t = self.tensors[key].detach()
            t = t if t.is_contiguous() else t.contiguous()  # one tensor at a time
            self._flat = (key, t.reshape(-1).view(torch.uint8))
        return self._flat[1]

    def message(
        self, ranges: list[Range], outgoing: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A message's bytes and their checksum: a view of one range, or a bundle's ranges
        gathered into one buffer (at most ``BUNDLE_BYTES``)."""
        if len(ranges) == 1:
            view = self._bytes(ranges[0].key)[ranges[0].lo : ranges[0].hi]
        else:
            view = torch.cat([self._bytes(r.key)[r.lo : r.hi] for r in ranges])
        check = torch.tensor([_checksum(view)], dtype=torch.int64, device=self.device)
        data = view if view.device == torch.device(self.device) else view.to(self.device)
        return outgoing(data), check


class _Sink:
    """A receiver's storage for its template's tensors, filled range by range."""

    def __init__(self, template: Offer, job: CopyJob, moved: Set[str]) -> None:
        assert job.target is not None
        self.template = template
        self.tensors: dict[str, torch.Tensor] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self._later: dict[str, torch.Tensor] = {}
        for key, (shape, dtype) in template.tensors.items():
            t = job.target(key, shape, TORCH_DTYPES[dtype])
            self.tensors[key] = t
            if key not in moved:  # a paced copy's other parts: kept as they are
                continue
            if not t.is_contiguous():  # received whole, copied in once complete
                stand_in = torch.empty(shape, dtype=t.dtype, device=t.device)
                self._later[key] = stand_in
                t = stand_in
            self._flat[key] = t.detach().reshape(-1).view(torch.uint8)
        self.nbytes = sum(template.nbytes(k) for k in moved)

    def message(
        self, ranges: list[Range], device: torch.device, bad: list[int]
    ) -> tuple[torch.Tensor, Callable[[int], None]]:
        """Where a message lands, and what checks it once it did: one range straight into
        its tensor where the group's device allows; a bundle into one buffer, copied out
        range by range once its checksum matched (else all its ranges are bad)."""
        views = [self._flat[r.key][r.lo : r.hi] for r in ranges]
        direct = len(views) == 1 and views[0].device == torch.device(device)
        size = sum(v.numel() for v in views)
        buf = views[0] if direct else torch.empty(size, dtype=torch.uint8, device=device)

        def done(check: int) -> None:
            if _checksum(buf) != check:
                bad.extend(r.index for r in ranges)
                return
            if not direct:
                at = 0
                for v in views:
                    v.copy_(buf[at : at + v.numel()])
                    at += v.numel()

        return buf, done

    def received(self, template: int, holders: list[int], refetched: int) -> Received:
        with torch.no_grad():
            for key, stand_in in self._later.items():
                self.tensors[key].copy_(stand_in)
        t = self.template
        try:
            optimizer = unflatten_optimizer(t.optimizer, self.tensors)
        except (KeyError, ValueError, TypeError) as e:  # checked in _check_template too
            msg = f"state copy: rank {template}'s optimizer structure: {e}"
            raise StateCopyFailed(msg) from e
        model = model_of(self.tensors)
        return Received(model, optimizer, t.extra, self.nbytes, template, holders, refetched)


# -- offers ------------------------------------------------------------------------------


def _encode_offer(
    model: dict[str, torch.Tensor], optim: dict[str, Any], extra: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], bytes]:
    tensors, structure = flatten(model, optim)
    meta = [[k, list(t.shape), DTYPES[t.dtype]] for k, t in tensors.items()]
    return tensors, json.dumps({"tensors": meta, "optimizer": structure, "extra": extra}).encode()


CONTROL_TAG = 1 << 30
"""The first tag of the copy's own messages (the offers, their sizes, the failed ranges):
above every range's (``2 * index % 2**30``, and its checksum's, one more)."""


HEAD_BYTES = 32 << 10
"""The first message of every rank's offer to every other rank: the offer's length (8
bytes) and its first ``HEAD_BYTES - 8`` bytes. An offer that fits (a model of a few
hundred tensors) goes in one exchange; a longer one sends its remainder in a second,
whose sizes every rank read from the heads. One exchange, not two (its size, then its
bytes): each is a round trip whose messages wait for a thread of every holder, and the
holders are computing (docs/performance.md, section 17)."""


def _exchange_bytes(
    comm: Comm, raw: bytes, timeout: timedelta, quiet: frozenset[int] = frozenset()
) -> list[bytes]:
    """Every rank's ``raw``, sent point to point to every other rank (:func:`_gather`): a
    head of ``HEAD_BYTES`` (its length, its first bytes), then whatever did not fit. The
    ``quiet`` ranks (the receivers: they offer nothing) send nothing; theirs is empty."""
    dev, room = comm.device, HEAD_BYTES - 8
    if comm.rank in quiet:
        raw = b""
    head = bytearray(HEAD_BYTES)
    head[:8] = len(raw).to_bytes(8, "little")
    head[8 : 8 + min(len(raw), room)] = raw[:room]
    mine = torch.frombuffer(head, dtype=torch.uint8).to(dev)
    sizes = [0 if r in quiet else HEAD_BYTES for r in range(comm.size)]
    heads = [
        bytes(h.cpu().numpy().tobytes()) for h in _gather(comm, mine, sizes, CONTROL_TAG, timeout)
    ]
    lengths = [int.from_bytes(h[:8], "little", signed=True) if h else 0 for h in heads]
    if max(lengths) > MAX_OFFER_BYTES or min(lengths) < 0:
        raise StateCopyFailed(
            f"state copy: an offered structure of {max(lengths)} bytes (the limit is "
            f"MAX_OFFER_BYTES = {MAX_OFFER_BYTES})"
        )
    rest = [max(0, n - room) for n in lengths]
    tails = [b""] * comm.size
    if max(rest) > 0:
        left = raw[room:]
        tail = torch.frombuffer(bytearray(left), dtype=torch.uint8) if left else torch.empty(0)
        outs = _gather(comm, tail.to(dtype=torch.uint8, device=dev), rest, CONTROL_TAG + 1, timeout)
        tails = [
            bytes(o.cpu().numpy().tobytes()) if n else b"" for o, n in zip(outs, rest, strict=True)
        ]
    return [h[8 : 8 + min(n, room)] + t for h, n, t in zip(heads, lengths, tails, strict=True)]


def _gather(
    comm: Comm, mine: torch.Tensor, counts: list[int], tag: int, timeout: timedelta
) -> list[torch.Tensor]:
    """Every rank's tensor of ``mine``'s dtype (rank ``r``'s holds ``counts[r]`` values),
    each sent point to point to every other rank, all posted before any is waited on, in
    one global order of (sender, receiver) pairs: a backend that runs a rank's operations
    one after another (NCCL's stream) meets no cycle of waits.

    Not the backend's all-gather: gloo's ring all-gather (and its all-reduce of more than
    two values) took 2.7-3.2 ms median here for 8 bytes among three ranks, its send/recv
    0.1 ms; the copy's offers and verdict are on a kill's critical path. Each rank sends
    ``size - 1`` messages: small ones (the offers' structure), so the count, not the
    bytes, is the cost, and it is one round trip."""
    dev, pg = comm.device, comm.pg

    def run() -> list[torch.Tensor]:
        me = comm.rank
        outs = [
            mine if r == me else torch.empty(n, dtype=mine.dtype, device=dev)
            for r, n in enumerate(counts)
        ]
        works = []
        for src, dst in itertools.permutations(range(comm.size), 2):  # one global order
            if counts[src] and me == src:
                works.append(pg.send([mine], dst, tag))
            elif counts[src] and me == dst:
                works.append(pg.recv([outs[src]], src, tag))
        for w in works:
            w.wait(timeout)
        return outs

    return comm.call(run)


def _parse_all(raws: list[bytes], receivers: set[int]) -> dict[int, Offer]:
    """The holders' offers that parse and check (the same verdict on every rank)."""
    offers = {}
    for rank, raw in enumerate(raws):
        if rank in receivers:
            continue
        offer = _parse(rank, raw)
        if offer is not None:
            offers[rank] = offer
    return offers


def _parse(rank: int, raw: bytes) -> Offer | None:
    try:
        h = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(h, dict) or not isinstance(h.get("tensors"), list):
        return None
    extra = h.get("extra")
    if not isinstance(extra, dict) or not isinstance(extra.get("next_step"), int):
        return None
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for item in h["tensors"]:
        if not (isinstance(item, list) and len(item) == 3):
            return None
        key, shape, dtype = item
        ok = isinstance(key, str) and key not in tensors and dtype in ITEMSIZE
        ok = ok and isinstance(shape, list) and len(shape) <= 16
        ok = ok and all(type(d) is int and 0 <= d < 1 << 48 for d in shape)
        if not ok:
            return None
        tensors[key] = (tuple(shape), dtype)
    return Offer(rank, tensors, h.get("optimizer"), extra)


def _template(receiver: int, job: CopyJob, offers: dict[int, Offer]) -> int:
    """The holder whose offer ``receiver`` copies (checked; the same on every rank)."""
    source = offers.get(job.source)
    if source is None:
        raise StateCopyFailed(
            f"state copy: the source (rank {job.source}) offered no usable structure"
        )
    chosen = source
    if job.shard_degree > 1:
        own = shard_of(receiver, job.shard_degree)
        step = source.extra["next_step"]
        same = [
            o
            for _, o in sorted(offers.items())
            if o.extra.get("held") == own and o.extra["next_step"] == step
        ]
        chosen = same[0] if same else source
    _check_template(chosen, job.layout)
    return chosen.rank


def _check_template(offer: Offer, layout: Layout) -> None:
    """An offer checked against the model every rank built: model tensors by name, shape
    and dtype; the optimizer's bytes bounded; its structure decodable."""
    where = f"state copy: rank {offer.rank}'s offer"
    extra = offer.extra
    if not isinstance(extra.get("data"), dict) or not isinstance(extra.get("decisions"), list):
        raise StateCopyFailed(
            f"{where}: extra must hold 'data' (an object) and 'decisions' (a list)"
        )
    model_bytes = sum(
        ITEMSIZE[DTYPES[dt]] * int(torch.Size(shape).numel()) for shape, dt in layout.values()
    )
    optim_bytes = 0
    for key, (shape, dtype) in offer.tensors.items():
        if key.startswith(MODEL):
            name = key[len(MODEL) :]
            want = layout.get(name)
            if want is None or want[0] != shape or DTYPES[want[1]] != dtype:
                raise StateCopyFailed(
                    f"{where}: {key} is {dtype} {list(shape)}, this model has "
                    f"{'no such tensor' if want is None else f'{DTYPES[want[1]]} {list(want[0])}'}"
                )
        else:
            optim_bytes += offer.nbytes(key)
    if optim_bytes > OPTIMIZER_FACTOR * model_bytes + (1 << 20):
        raise StateCopyFailed(
            f"{where}: optimizer tensors of {optim_bytes} bytes, more than OPTIMIZER_FACTOR "
            f"({OPTIMIZER_FACTOR}) times the model's {model_bytes}"
        )
    metas = {
        k: torch.empty(s, dtype=TORCH_DTYPES[d], device="meta")
        for k, (s, d) in offer.tensors.items()
    }
    try:
        unflatten_optimizer(offer.optimizer, metas)
    except Exception as e:  # a peer's JSON: any failure to decode is a refusal
        raise StateCopyFailed(f"{where}: its optimizer structure does not decode: {e}") from e


def _plan(
    job: CopyJob,
    offers: dict[int, Offer],
    templates: dict[int, int],
    chunk: int,
    moved: dict[int, Set[str]] | None = None,
) -> list[Range]:
    """Every receiver's ranges, in the global order (receiver, index), each first asked
    of the eligible holder with the fewest bytes assigned so far (ties: the receiver's
    position rotates the order, so receivers start at different holders). By bytes, not
    by count: a state's tensors repeat in patterns (AdamW: a 4-byte step, then two
    moments per parameter) that a round-robin over ranges would give one holder alone.

    Ranges are assigned fewest eligible holders first (then in the global order): with
    replica groups a receiver's optimizer shard is offered only by the ranks that hold
    that shard, its parameters by every holder, and assigned in the state's order the
    shard's holder took a share of the parameters before its shard too (measured: one
    holder of three sent 11 of a spare's 16.5 MB, docs/performance.md section 17)."""
    cut: list[tuple[Range, int]] = []  # each range (its holder not chosen yet), its slot
    for slot, dst in enumerate(sorted(job.receivers)):
        t = offers[templates[dst]]
        step = t.extra["next_step"]
        index = 0
        keys = _moved(t, job) if moved is None else moved[templates[dst]]
        for key, meta in t.tensors.items():
            if key not in keys:
                continue
            eligible = tuple(
                r
                for r, o in sorted(offers.items())
                if o.tensors.get(key) == meta and o.extra["next_step"] == step
            )
            n = t.nbytes(key)
            for lo in range(0, n, chunk):
                cut.append((Range(dst, index, key, lo, min(n, lo + chunk), eligible, 0), slot))
                index += 1
    load: dict[int, int] = dict.fromkeys(offers, 0)
    ranges = [r for r, _ in cut]
    for i in sorted(range(len(cut)), key=lambda i: len(ranges[i].eligible)):  # stable
        r, slot = cut[i]
        k = len(r.eligible)
        first = min(range(k), key=lambda j: (load[r.eligible[j]], (j - slot) % k))
        load[r.eligible[first]] += r.hi - r.lo + MESSAGE_COST
        ranges[i] = dataclasses.replace(r, first=first)
    return ranges


def _moved(template: Offer, job: CopyJob) -> Set[str]:
    """The template's keys this copy moves (``CopyJob.select``)."""
    if job.select is None:
        return set(template.tensors)
    return job.select([(k, template.nbytes(k)) for k in template.tensors], template.extra)


def _exchange_failed(
    comm: Comm, bad: list[int], timeout: timedelta, most: int, receivers: tuple[int, ...]
) -> list[tuple[int, int]]:
    """Every receiver's failed ranges as (receiver, index), in that order, on every rank.
    Only a receiver checks ranges, so only the receivers send: a holder waits for them
    alone, not for the other holders, whose threads run beside their compute. ``most``:
    how many ranges the copy has; a receiver that claims more failed is refused
    (StateCopyFailed), not allocated for."""
    dev = comm.device
    sends = [1 if r in receivers else 0 for r in range(comm.size)]
    count = torch.tensor([len(bad) if sends[comm.rank] else 0], dtype=torch.int64, device=dev)
    got = _gather(comm, count, sends, CONTROL_TAG + 2, timeout)
    counts = [int(c.item()) if n else 0 for c, n in zip(got, sends, strict=True)]
    if max(counts) > most or min(counts) < 0:
        raise StateCopyFailed(
            f"state copy: a rank reports {max(counts)} failed ranges of the copy's {most}"
        )
    if max(counts) == 0:
        return []
    mine = torch.tensor(bad, dtype=torch.int64).to(dev)
    outs = _gather(comm, mine, counts, CONTROL_TAG + 3, timeout)
    return [(rank, int(i)) for rank, o in enumerate(outs) for i in o.cpu().tolist()]
