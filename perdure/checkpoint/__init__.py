"""Checkpoints that carry their context: format 1.1 (docs/checkpoint-format.md).

Seven fields written together and loaded together: weights, optimizer state, rng seeds,
data offset, config hash, cluster topology, commit sha (plus the decision log). Tensors
go to safetensors files written straight from tensor memory, context to JSON, and a
manifest with every file's size and CRC-32, sealed with its own SHA-256, commits the
checkpoint. Every reader enforces the spec's structural rules before it allocates. No
pickle anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Re-exported lazily: the config layer imports perdure.checkpoint.config, and a process that
# only checks configs or plans (the simulator, `perdure config check`) must not import torch.
_EXPORTS = {
    "AsyncCheckpointer": "perdure.checkpoint.async_save",
    "apply_retention": "perdure.checkpoint.discovery",
    "latest_checkpoint": "perdure.checkpoint.discovery",
    "list_checkpoints": "perdure.checkpoint.discovery",
    "CheckpointError": "perdure.checkpoint.errors",
    "CheckpointSaveError": "perdure.checkpoint.errors",
    "CorruptCheckpointError": "perdure.checkpoint.errors",
    "FormatVersionError": "perdure.checkpoint.errors",
    "IncompatibleCheckpointError": "perdure.checkpoint.errors",
    "LegacyManifestWarning": "perdure.checkpoint.errors",
    "check_compatible": "perdure.checkpoint.loader",
    "config_override_entry": "perdure.checkpoint.loader",
    "load_checkpoint": "perdure.checkpoint.loader",
    "verify_checkpoint": "perdure.checkpoint.loader",
    "read_manifest": "perdure.checkpoint.manifest",
    "capture_rng": "perdure.checkpoint.rng",
    "restore_rng": "perdure.checkpoint.rng",
    "CheckpointState": "perdure.checkpoint.state",
    "LoadedCheckpoint": "perdure.checkpoint.state",
    "state_digest": "perdure.checkpoint.state",
    "Exchange": "perdure.checkpoint.writer",
    "save_checkpoint": "perdure.checkpoint.writer",
}

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
assert set(__all__) == set(_EXPORTS)

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'perdure.checkpoint' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
