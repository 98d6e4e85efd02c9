"""Errors of the data layer.

Every message names the file (or URL, or field), the rule that was broken and the value
received, so that an operator can act on one line without reading a stack trace.
"""

from __future__ import annotations


class DataError(ValueError):
    """A dataset, manifest, part, order or data state that breaks a rule."""


class PartError(DataError):
    """One part cannot be served: missing, unreadable or failing its checksum.

    Raised by :class:`~perdure.data.dataset.Dataset` reads; the slot loader turns it into a
    quarantine request instead of a crash (see ``docs/data.md``, "Bad parts").
    """

    def __init__(self, part: int, file: str, reason: str, *, found: str | None = None) -> None:
        self.part = part
        self.file = file
        self.reason = reason
        self.found = found
        """The SHA-256 the bytes read had, for a checksum mismatch (None otherwise)."""
        super().__init__(f"part {part} ({file}): {reason}")

    def with_note(self, note: str) -> PartError:
        """The same error with ``note`` added to its reason (what else was tried)."""
        return PartError(self.part, self.file, f"{self.reason}; {note}", found=self.found)

    def again(self) -> PartError:
        """A fresh copy, to raise once more (a remembered bad part)."""
        return PartError(self.part, self.file, self.reason, found=self.found)


class CorruptPartError(DataError):
    """A part with no good copy under ``data.on_corrupt = "stop"``: the run ends before
    any of its samples is trained on. The message names the part file, both checksums
    (where the bytes could be read) and ``perdure data verify``."""

    def __init__(self, error: PartError, expected: str, step: int) -> None:
        self.error, self.step = error, step
        sums = "" if expected in error.reason else f" (the manifest's SHA-256 is {expected})"
        super().__init__(
            f"part {error.part} ({error.file}) cannot be served at step {step}: "
            f"{error.reason}{sums}. The run stops "
            "before training on it (data.on_corrupt = 'stop'): run `perdure data verify "
            "DATASET` to list every bad part, restore them from a good copy or set "
            "data.mirrors, and resume from the last checkpoint; or set data.on_corrupt = "
            "'quarantine' to leave the part out (a decision-log entry)"
        )


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
