"""In-process faults on the wire: what the launcher posts in the store, what a worker reads.

The launcher sets ``chaos/<target>`` (a worker or a region name) to one JSON object; each
worker's heartbeat thread reads its own keys. The value crosses a process boundary and the
store is writable by anyone who can reach it, so the reader trusts nothing: :func:`decode`
checks every field and raises :class:`BadMessage` with the reason, and the worker ignores
(and logs) what it cannot use instead of letting its heartbeat thread die. ``seq`` grows
with every post, so a worker applies each message once.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from perdure.chaos.control import ClusterControl

PREFIX = "chaos/"
_SEQ = itertools.count(1)


class BadMessage(ValueError):
    """A value under a chaos key that is not a message this code can apply."""


@dataclass(frozen=True)
class Message:
    """One in-process fault for the worker (or region) named by the key."""

    kind: str
    seq: int
    delay_ms: int = 0
    """For ``delay``: extra latency per heartbeat and data-plane send."""
    duration_s: float | None = None
    """For ``delay``: how long it lasts; ``None``: for ever."""


def key(target: str) -> str:
    return PREFIX + target


def post(control: ClusterControl, target: str, kind: str, **fields: Any) -> bool:
    """Post a fault of ``kind`` for ``target``; whether the store took it."""
    message = Message(kind=kind, seq=next(_SEQ), **fields)
    return control.post(key(target), json.dumps(asdict(message)))


def decode(raw: bytes | str, kinds: frozenset[str]) -> Message:
    """The message in ``raw``, if it is one of ``kinds`` and every field is well-formed."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadMessage(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadMessage(f"not a JSON object: {type(data).__name__}")
    unknown = set(data) - {"kind", "seq", "delay_ms", "duration_s"}
    if unknown:
        raise BadMessage(f"unknown fields {sorted(unknown)}")
    kind = data.get("kind")
    _require(isinstance(kind, str) and kind in kinds, f"kind must be one of {sorted(kinds)}", kind)
    _require(
        _is_int(data.get("seq")) and data["seq"] > 0, "seq must be an int > 0", data.get("seq")
    )
    delay = data.get("delay_ms", 0)
    _require(_is_int(delay) and delay >= 0, "delay_ms must be an int >= 0", delay)
    duration = data.get("duration_s")
    _require(duration is None or _is_positive(duration), "duration_s must be > 0", duration)
    return Message(kind=str(kind), seq=data["seq"], delay_ms=delay, duration_s=duration)


def _require(ok: bool, rule: str, value: object) -> None:
    if not ok:
        raise BadMessage(f"{rule} (got {value!r})")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_positive(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return math.isfinite(v) and v > 0
