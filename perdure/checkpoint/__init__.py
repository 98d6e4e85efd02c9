"""Checkpoints that carry their context: format 1.1 (docs/checkpoint-format.md).

Seven fields written together and loaded together: weights, optimizer state, rng seeds,
data offset, config hash, cluster topology, commit sha (plus the decision log). Tensors
go to safetensors files written straight from tensor memory, context to JSON, and a
manifest with every file's size and CRC-32, sealed with its own SHA-256, commits the
checkpoint. Every reader enforces the spec's structural rules before it allocates. No
pickle anywhere.
"""

from perdure.checkpoint.async_save import AsyncCheckpointer
from perdure.checkpoint.discovery import apply_retention, latest_checkpoint, list_checkpoints
from perdure.checkpoint.errors import (
    CheckpointError,
    CheckpointSaveError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompatibleCheckpointError,
    LegacyManifestWarning,
)
from perdure.checkpoint.loader import (
    check_compatible,
    config_override_entry,
    load_checkpoint,
    verify_checkpoint,
)
from perdure.checkpoint.manifest import read_manifest
from perdure.checkpoint.rng import capture_rng, restore_rng
from perdure.checkpoint.state import CheckpointState, LoadedCheckpoint, state_digest
from perdure.checkpoint.writer import Exchange, save_checkpoint

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointSaveError",
    "CheckpointState",
    "CorruptCheckpointError",
    "Exchange",
    "FormatVersionError",
    "IncompatibleCheckpointError",
    "LegacyManifestWarning",
    "LoadedCheckpoint",
    "apply_retention",
    "capture_rng",
    "check_compatible",
    "config_override_entry",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_manifest",
    "restore_rng",
    "save_checkpoint",
    "state_digest",
    "verify_checkpoint",
]
