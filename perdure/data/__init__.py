"""perdure.data: versioned datasets and a deterministic, slot-addressed loader.

Build a dataset (:func:`build_dataset`), open it from any fsspec URL (:class:`Dataset`),
and read slot ``s`` of step ``t`` with :class:`SlotLoader`. See ``docs/data.md``.

Exports are imported lazily (PEP 562), so that ``perdure.data.config``, which the run
config imports, does not pull numpy and fsspec into every ``perdure`` command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Batch": "batch",
    "CorruptPartError": "errors",
    "DataError": "errors",
    "DataState": "state",
    "Dataset": "dataset",
    "EntryTokenizer": "tokenizer_entry",
    "Field": "fields",
    "FieldSpec": "fields",
    "Manifest": "manifest",
    "Order": "order",
    "Quarantine": "quarantine",
    "QuarantineEntry": "quarantine",
    "PartError": "errors",
    "PartInfo": "manifest",
    "SlotLoader": "loader",
    "build_dataset": "build",
    "byte_tokenizer": "tokenize",
    "import_arrays": "importer",
    "load_tokenizer": "tokenizer_entry",
    "parse_manifest": "manifest",
    "permute": "order",
    "position_to_sample": "order",
    "positions_to_samples": "order",
    "slot_positions": "slots",
    "verify_dataset": "verify",
}

__all__ = [
    "Batch",
    "CorruptPartError",
    "DataError",
    "DataState",
    "Dataset",
    "EntryTokenizer",
    "Field",
    "FieldSpec",
    "Manifest",
    "Order",
    "PartError",
    "PartInfo",
    "Quarantine",
    "QuarantineEntry",
    "SlotLoader",
    "build_dataset",
    "byte_tokenizer",
    "import_arrays",
    "load_tokenizer",
    "parse_manifest",
    "permute",
    "position_to_sample",
    "positions_to_samples",
    "slot_positions",
    "verify_dataset",
]

if TYPE_CHECKING:
    from perdure.data.batch import Batch
    from perdure.data.build import build_dataset
    from perdure.data.dataset import Dataset
    from perdure.data.errors import CorruptPartError, DataError, PartError
    from perdure.data.fields import Field, FieldSpec
    from perdure.data.importer import import_arrays
    from perdure.data.loader import SlotLoader
    from perdure.data.manifest import Manifest, PartInfo, parse_manifest
    from perdure.data.order import Order, permute, position_to_sample, positions_to_samples
    from perdure.data.quarantine import Quarantine, QuarantineEntry
    from perdure.data.slots import slot_positions
    from perdure.data.state import DataState
    from perdure.data.tokenize import byte_tokenizer
    from perdure.data.tokenizer_entry import EntryTokenizer, load_tokenizer
    from perdure.data.verify import verify_dataset


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'perdure.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"perdure.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
