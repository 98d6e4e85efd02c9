"""The control channel's wire format: typed, versioned messages, one JSON object per line.

This module owns the format. Every message is a frozen dataclass; ``encode`` writes one
line and ``decode`` is the only way back: it checks the size, the encoding, that the line
is a JSON object, that its ``type`` is known, and that every field is present with the
declared type and within bounds (unknown fields are refused: within one protocol version
both ends know the same fields). Anything else raises :class:`ProtocolError`, which the
coordinator turns into a log line and a disconnect, never a crash: a peer's bytes,
authenticated or not, cannot take the control plane down.

The version travels in the hello; a coordinator refuses a worker that speaks another one
(``PROTOCOL_VERSION`` changes whenever a message or field changes). Version 2 added the
coordinator *generation* (the fencing token of ``control/lease.py``): every welcome,
announcement and start carries the generation of the coordinator that sent it, a hello
carries the newest one the worker followed, the challenge says whether its sender is
serving, and a refusal may say "retry" (a standby that does not hold the lease, or a
coordinator renewing its own). Version 3 added the heartbeat's ``sent`` stamp, from which
the coordinator measures each member's link latency (``control/lag.py``). Version 4 added
the ready's ``shard``: which shard of a replica group's optimizer state the member holds.
Version 5 added the ready's ``kept`` (the slots it holds finished of the step it would
redo) and the start's ``first`` (the plan of that one step, ``plan.redo_plan``).

Limits: a line is at most ``MAX_LINE`` bytes (the welcome, which carries the run config,
is the largest message); strings, lists and nesting are bounded so that decoding is cheap
whatever a peer sends.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union

from perdure.config.build import type_hints

PROTOCOL_VERSION = 5
MAX_LINE = 1 << 20
"""Bytes in one message line, newline excluded."""
MAX_STR = 4096
MAX_LIST = 4096
MAX_DEPTH = 12
MAX_INT = 1 << 53
RUN_OVER = "the run is over"
"""The refusal's reason for a worker that comes back after the run ended."""


class ProtocolError(ValueError):
    """A line that is not a valid message of this protocol version (says which rule)."""


# -- messages from a worker ------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A worker asks to be admitted; ``mac`` answers the challenge's nonce."""

    type: ClassVar[str] = "hello"
    name: str
    region: str
    role: str
    pid: int
    next_step: int
    has_state: bool
    epoch: int
    mac: str
    generation: int = 0
    """The newest coordinator generation this worker followed (0: none yet). A coordinator
    of an older generation that reads it knows it was superseded and fences itself out."""
    version: int = PROTOCOL_VERSION
    address: str = ""
    """The address its data plane (gloo, NCCL) listens on, where its peers reach it."""


@dataclass(frozen=True)
class Heartbeat:
    """Liveness, progress and speed; ``prepared``: its trainer is built."""

    type: ClassVar[str] = "hb"
    next_step: int
    prepared: bool
    slot_s: float | None = None
    sent: float | None = None
    """The sender's wall clock when it stamped this heartbeat, before the link carried it."""


@dataclass(frozen=True)
class Ready:
    """Phase 2 of an epoch change: the member stopped and reports where it stands."""

    type: ClassVar[str] = "ready"
    epoch: int
    next_step: int
    has_state: bool
    shard: int = -1
    """The shard of the optimizer state it holds (``train.shard_degree`` > 1); -1: all of
    it, -2: none (``runtime/shard_plan.py``)."""
    kept: list[int] = field(default_factory=list)
    """Slots of step ``next_step`` it holds finished from an abandoned attempt (salvage,
    ``runtime/replica/salvage.py``); at most ``MAX_LIST`` of them are reported."""


@dataclass(frozen=True)
class Fail:
    """A collective of ``epoch`` failed on this member."""

    type: ClassVar[str] = "fail"
    epoch: int
    error: str


@dataclass(frozen=True)
class Leave:
    """A graceful stop: leave at the next step boundary."""

    type: ClassVar[str] = "leave"


@dataclass(frozen=True)
class Evict:
    """Members agree that ``worker`` returns bad results (a hardware suspect)."""

    type: ClassVar[str] = "evict"
    worker: str
    reason: str


@dataclass(frozen=True)
class Done:
    """The member finished the last step and its final checkpoint."""

    type: ClassVar[str] = "done"
    next_step: int
    final_hash: str


@dataclass(frozen=True)
class Abort:
    """The run cannot go on: every replica hits the same error (e.g. a non-finite update
    from finite gradients). The coordinator stops every worker with ``reason``."""

    type: ClassVar[str] = "abort"
    reason: str


# -- messages from the coordinator -----------------------------------------------------------


@dataclass(frozen=True)
class Challenge:
    """The first line on a new connection: prove the run token by an HMAC of ``nonce``."""

    type: ClassVar[str] = "challenge"
    nonce: str
    generation: int = 0
    """The sender's coordinator generation (0: a standby that never held the lease)."""
    serving: bool = False
    """The sender holds the run's lease, or could renew it (its lease store answers): a
    standby's probe of the primary reads this, not just that the port answers."""
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Welcome:
    """Admitted: the run's config and where its store and directory are."""

    type: ClassVar[str] = "welcome"
    config: dict[str, Any]
    run_dir: str
    resume: str | None
    store_port: int
    epoch: int
    generation: int
    """The admitting coordinator's generation: the worker follows no older one after this."""
    allow_config_change: bool = False
    """Load ``resume`` even if written under another config hash (recorded as a decision)."""


@dataclass(frozen=True)
class Refused:
    """Not admitted, or disconnected for a protocol error; ``reason`` says why."""

    type: ClassVar[str] = "refused"
    reason: str
    retry: bool = False
    """Not now, rather than not ever: a standby without the lease, or a coordinator renewing
    or fenced out. The worker tries the next coordinator and comes back, within its join
    timeout."""


@dataclass(frozen=True)
class Announce:
    """Phase 1: the members of the next epoch (chain order) and its step boundary
    (``after = -1``: now, the in-flight step is abandoned)."""

    type: ClassVar[str] = "epoch"
    epoch: int
    members: list[str]
    after: int
    generation: int


@dataclass(frozen=True)
class Start:
    """Phase 3: the plan, the start step, who sends state and who receives it."""

    type: ClassVar[str] = "start"
    epoch: int
    plan: dict[str, Any]
    start_step: int
    source: str
    receivers: list[str]
    recover: bool
    reload: str | None
    prefix: str
    generation: int
    """Of the coordinator that started the epoch; every write of the epoch's members (a
    step's metrics line, a checkpoint commit) is checked against the run directory's
    fence with it."""
    first: dict[str, Any] | None = None
    """The plan of ``start_step`` alone (the step redone after a loss), where it differs
    from ``plan``: the members that hold slots finished take the lost ones beside them
    (``plan.redo_plan``). None: ``plan`` from the first step on."""


@dataclass(frozen=True)
class Drain:
    """Stop the run early, cleanly: finish step ``step - 1``, write the final checkpoint
    (all members, as at the end of a run), report done. ``reason``: who asked (a signal)."""

    type: ClassVar[str] = "drain"
    step: int
    reason: str


@dataclass(frozen=True)
class Stop:
    """The run is over for this worker."""

    type: ClassVar[str] = "stop"
    reason: str


FromWorker = Hello | Heartbeat | Ready | Fail | Leave | Evict | Done | Abort
FromCoordinator = Challenge | Welcome | Refused | Announce | Start | Drain | Stop
Message = FromWorker | FromCoordinator

_TYPES: dict[str, type[Any]] = {
    cls.type: cls
    for cls in (
        Hello,
        Heartbeat,
        Ready,
        Fail,
        Leave,
        Evict,
        Done,
        Abort,
        Challenge,
        Welcome,
        Refused,
        Announce,
        Start,
        Drain,
        Stop,
    )
}


def encode(msg: Message) -> bytes:
    """One line: the message's fields and its ``type``."""
    body = {"type": msg.type, **{f.name: getattr(msg, f.name) for f in fields(msg)}}
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    assert len(data) <= MAX_LINE, f"{msg.type} message of {len(data)} bytes"
    return data + b"\n"


def decode(line: bytes) -> Message:
    """The message on one line (without its newline), or :class:`ProtocolError`."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"line of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError(f"not a JSON line: {_short(e)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message is a JSON object, got {type(obj).__name__}")
    kind = obj.pop("type", None)
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(kind)}")
    return cls(**_fields(cls, obj))


def _fields(cls: type[Any], obj: dict[str, Any]) -> dict[str, Any]:
    hints = type_hints(cls)
    declared = {f.name: f for f in fields(cls)}
    extra = sorted(set(obj) - set(declared))
    if extra:
        raise ProtocolError(f"{cls.type}: unknown field {_short(extra[0])}")
    out = {}
    for name, f in declared.items():
        if name not in obj:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise ProtocolError(f"{cls.type}: missing field {name!r}")
        _check(obj[name], hints[name], f"{cls.type}.{name}", 0)
        out[name] = obj[name]
    return out


def _check(value: Any, hint: Any, where: str, depth: int) -> None:
    """``value`` (decoded JSON) has the type ``hint`` and is within the bounds."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH}")
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        if not any(_fits(value, h, where, depth) for h in typing.get_args(hint)):
            raise ProtocolError(f"{where}: expected {_name(hint)}, got {_short(value)}")
        return
    if not _fits(value, hint, where, depth):
        raise ProtocolError(f"{where}: expected {_name(hint)}, got {_short(value)}")


def _fits(value: Any, hint: Any, where: str, depth: int) -> bool:
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _bounded_int(value, where)
        return False
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok and math.isfinite(value) and abs(value) <= MAX_INT
    if hint is str:
        if not isinstance(value, str):
            return False
        if len(value) > MAX_STR:
            raise ProtocolError(f"{where}: string of {len(value)} characters exceeds {MAX_STR}")
        return True
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            return False
        _bounded_len(value, where)
        (item,) = typing.get_args(hint)
        for i, v in enumerate(value):
            _check(v, item, f"{where}[{i}]", depth + 1)
        return True
    if origin is dict:
        if not isinstance(value, dict):
            return False
        _bounded_len(value, where)
        _check_json(value, where, depth + 1)
        return True
    raise AssertionError(f"unsupported field type {hint!r} at {where}")


def _check_json(value: Any, where: str, depth: int) -> None:
    """Any JSON value, bounded in depth and size (a config or a plan)."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        _bounded_len(value, where)
        for k, v in value.items():
            _check_json(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        _bounded_len(value, where)
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{where}: not a finite number")


def _bounded_int(value: int, where: str) -> bool:
    if abs(value) > MAX_INT:
        raise ProtocolError(f"{where}: integer out of range")
    return True


def _bounded_len(value: list[Any] | dict[str, Any], where: str) -> None:
    if len(value) > MAX_LIST:
        raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST}")


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not JSON")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


class LineBuffer:
    """Bytes in, complete messages out, with a bound on what a line may buffer.

    A peer that sends more than ``MAX_LINE`` bytes without a newline gets a
    :class:`ProtocolError` at once: nothing buffers without limit.
    """

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buf = bytearray()
        self.max_line = max_line

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        *lines, rest = bytes(self._buf).split(b"\n")
        if len(rest) > self.max_line:
            raise ProtocolError(f"{len(rest)} bytes without a newline exceed {self.max_line}")
        self._buf = bytearray(rest)
        return [decode(line) for line in lines if line.strip()]


__all__ = [
    "MAX_LINE",
    "PROTOCOL_VERSION",
    "Abort",
    "Announce",
    "Challenge",
    "Done",
    "Drain",
    "Evict",
    "Fail",
    "FromCoordinator",
    "FromWorker",
    "Heartbeat",
    "Hello",
    "Leave",
    "LineBuffer",
    "Message",
    "ProtocolError",
    "Ready",
    "Refused",
    "Start",
    "Stop",
    "Welcome",
    "decode",
    "encode",
]
