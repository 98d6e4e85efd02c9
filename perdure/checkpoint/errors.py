"""Errors of the checkpoint format: each names the file, the rule it broke and the value.

A checkpoint that cannot be trusted is never loaded silently; the message must let an
operator find the bad file without reading code.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: something about a checkpoint (or its writing) is wrong."""


class CorruptCheckpointError(CheckpointError):
    """A file of a checkpoint is missing, truncated, malformed or fails its checksum."""

    def __init__(self, file: str, problem: str) -> None:
        self.file = file
        self.problem = problem
        super().__init__(f"{file}: {problem}")


class FormatVersionError(CheckpointError):
    """The manifest names a format or major version this reader does not know."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint was written under a different config hash than the run's."""


class CheckpointSaveError(CheckpointError):
    """A save failed (in the background, or on another writer of a parallel save)."""


class LegacyManifestWarning(UserWarning):
    """A format 1.0 checkpoint is being read: its manifest carries no checksum of its own,
    so only the structural rules (and the files' CRCs) stand between a corrupt manifest
    and the state it describes. Re-saving the state writes a sealed 1.1 manifest."""
