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
    "RunConfig": "perdure.config.run",
    "load_config": "perdure.config.run",
    "config_hash": "perdure.config.run",
    "provenance": "perdure.provenance",
}

__all__ = ["ConfigError", "RunConfig", "__version__", "config_hash", "load_config", "provenance"]
assert set(__all__) == {"__version__", *_EXPORTS}

if TYPE_CHECKING:
    from perdure.config.errors import ConfigError
    from perdure.config.run import RunConfig, config_hash, load_config
    from perdure.provenance import provenance


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'perdure' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
