"""perdure.data: versioned datasets and a deterministic, slot-addressed loader.

Build a dataset (:func:`build_dataset`), open it from any fsspec URL (:class:`Dataset`),
and read slot ``s`` of step ``t`` with :class:`SlotLoader`. See ``docs/data.md``.
"""

from perdure.data.batch import Batch
from perdure.data.build import build_dataset
from perdure.data.dataset import Dataset
from perdure.data.errors import DataError, ShardError
from perdure.data.loader import SlotLoader
from perdure.data.manifest import Manifest, ShardInfo, parse_manifest
from perdure.data.order import Order, permute, position_to_sample, positions_to_samples
from perdure.data.quarantine import Quarantine, QuarantineEntry
from perdure.data.slots import slot_positions
from perdure.data.state import DataState
from perdure.data.tokenize import byte_tokenizer

__all__ = [
    "Batch",
    "DataError",
    "DataState",
    "Dataset",
    "Manifest",
    "Order",
    "Quarantine",
    "QuarantineEntry",
    "ShardError",
    "ShardInfo",
    "SlotLoader",
    "build_dataset",
    "byte_tokenizer",
    "parse_manifest",
    "permute",
    "position_to_sample",
    "positions_to_samples",
    "slot_positions",
]
