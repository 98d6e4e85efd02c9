"""perdure: data-parallel PyTorch training where faults are re-planning and resume is bit-exact.

The math of a run is a pure function of (config, dataset version, decision log); who
computes which slot, and how many workers there are, never changes a bit of the result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API is re-exported lazily: `perdure --version` and config checks must not pay
# for importing torch.
_EXPORTS = {
    "ConfigError": "perdure.config.errors",
    "RunConfig": "perdure.run_config",
    "load_config": "perdure.run_config",
    "config_hash": "perdure.run_config",
    "provenance": "perdure.provenance",
    "Task": "perdure.runtime.replica.task",
    "run": "perdure.launch.api",
    "load_checkpoint": "perdure.checkpoint",
    "state_digest": "perdure.checkpoint",
    "write_report": "perdure.report",
    "slot_generator": "perdure.runtime.replica.user_rng",
}

__all__ = [
    "ConfigError",
    "RunConfig",
    "Task",
    "__version__",
    "config_hash",
    "load_checkpoint",
    "load_config",
    "provenance",
    "run",
    "slot_generator",
    "state_digest",
    "write_report",
]
assert set(__all__) == {"__version__", *_EXPORTS}

if TYPE_CHECKING:
    from perdure.checkpoint import load_checkpoint, state_digest
    from perdure.config.errors import ConfigError
    from perdure.launch.api import run
    from perdure.provenance import provenance
    from perdure.report import write_report
    from perdure.run_config import RunConfig, config_hash, load_config
    from perdure.runtime.replica.task import Task
    from perdure.runtime.replica.user_rng import slot_generator


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'perdure' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
