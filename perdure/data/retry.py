"""Remote reads that outlast a flaky server: tries with backoff, and a deadline per request.

A dataset served over the network (``http(s)://``, ``s3://``, ...) answers some requests
with errors and stalls others; neither may end a run whose bytes are still there. Every
remote request of the data layer (the manifest, the listing, a part's download) runs
through :func:`with_retries`: an error or a stall past the deadline is tried again after
0.2 s, 0.4 s, ... (at most 5 s), up to ``data.read_attempts`` tries; a part still
unreadable after them follows the corrupt-part path (a mirror, then ``data.on_corrupt``).

The deadline: over HTTP it is aiohttp's ``sock_read`` and ``sock_connect`` timeout
(:func:`storage_options`), so a request whose server sends nothing for
``data.read_timeout_s`` is abandoned and tried again, while a long download that keeps
moving is not cut. A stall shorter than the deadline is waited out: the prefetch, one step
ahead, hides it from the step when the step is longer than the stall.

Limits: other protocols get the tries but no deadline of their own (their file systems'
own timeouts apply); a missing file (``FileNotFoundError``, HTTP 404) and a refused one
(``PermissionError``) are final at once, since asking again changes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger("perdure.data")

T = TypeVar("T")

FINAL = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
"""Errors that another try cannot change."""


@dataclass(frozen=True)
class ReadPolicy:
    """How one remote request is tried (``data.read_attempts``, ``data.read_timeout_s``)."""

    attempts: int = 6
    timeout_s: float = 30.0
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0

    def pause(self, attempt: int) -> float:
        """Seconds to wait after failed try ``attempt`` (1-based): exponential, capped."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))


class ReadFailed(OSError):
    """A remote request that failed every try: ``what`` it was, the tries, the last error."""

    def __init__(self, what: str, attempts: int, last: BaseException) -> None:
        self.what, self.attempts, self.last = what, attempts, last
        super().__init__(f"{what}: failed {attempts} tries, the last with "
                         f"{type(last).__name__}: {last}")  # fmt: skip


def with_retries(
    call: Callable[[], T],
    what: str,
    policy: ReadPolicy,
    *,
    sleep: Callable[[float], None] = time.sleep,
    counter: list[int] | None = None,
) -> T:
    """``call()``, tried up to ``policy.attempts`` times; raises :class:`ReadFailed`
    after the last, or a :data:`FINAL` error at once. ``counter[0]`` counts the retries."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return call()
        except FINAL:
            raise
        except Exception as e:  # a server's error, a reset, a timeout: try again
            if attempt == policy.attempts:
                raise ReadFailed(what, attempt, e) from e
            pause = policy.pause(attempt)
            log.info("data: %s: %s: %s; trying again in %.1f s (try %d of %d)", what,
                     type(e).__name__, e, pause, attempt + 1, policy.attempts)  # fmt: skip
            if counter is not None:
                counter[0] += 1
            sleep(pause)
    raise AssertionError("unreachable")  # attempts >= 1


def is_http(protocol: str | tuple[str, ...]) -> bool:
    protos = (protocol,) if isinstance(protocol, str) else protocol
    return any(p in ("http", "https") for p in protos)


def storage_options(url: str, timeout_s: float | None) -> dict[str, Any]:
    """fsspec options that give an HTTP(S) URL a deadline per request (none otherwise)."""
    if timeout_s is None or not url.startswith(("http://", "https://")):
        return {}
    import aiohttp  # fsspec's HTTP file system needs it anyway

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    return {"client_kwargs": {"timeout": timeout}}
