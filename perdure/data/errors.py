"""Errors of the data layer.

Every message names the file (or URL, or field), the rule that was broken and the value
received, so that an operator can act on one line without reading a stack trace.
"""

from __future__ import annotations


class DataError(ValueError):
    """A dataset, manifest, shard, order or data state that breaks a rule."""


class ShardError(DataError):
    """One shard cannot be served: missing, unreadable or failing its checksum.

    Raised by :class:`~perdure.data.dataset.Dataset` reads; the slot loader turns it into a
    quarantine request instead of a crash (see ``docs/data.md``, "Bad shards").
    """

    def __init__(self, shard: int, file: str, reason: str) -> None:
        self.shard = shard
        self.file = file
        self.reason = reason
        super().__init__(f"shard {shard} ({file}): {reason}")


class Problems:
    """Collects the broken rules of one file so that all of them are reported at once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[str] = []

    def check(self, ok: bool, field: str, rule: str, value: object) -> bool:
        if not ok:
            self.items.append(f"{field}: {rule} (got {value!r})")
        return ok

    def done(self) -> None:
        if self.items:
            n = len(self.items)
            head = f"{self.source}: {n} problem{'s' if n != 1 else ''}"
            raise DataError("\n  - ".join([head, *self.items]))
