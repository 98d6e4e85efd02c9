"""Small keyed hashes: SHA-256 for content, splitmix64 for the order and the resampling.

splitmix64's finaliser is a bijection on 64-bit words with full avalanche, cheap to
vectorise with numpy's wrapping ``uint64`` arithmetic; it is not a cryptographic PRF, which
is fine here: the order must look random to a model, not to an adversary.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

_U64 = np.uint64


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a ``uint64`` array (wrapping arithmetic, no warnings)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def derive_keys(label: str, count: int, *parts: int) -> tuple[int, ...]:
    """``count`` 64-bit keys from a label and integers (BLAKE2b; platform independent)."""
    text = "|".join([label, *(str(int(p)) for p in parts)]).encode()
    digest = hashlib.blake2b(text, digest_size=8 * count).digest()
    return tuple(int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(count))


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_hash(obj: Any) -> str:
    """``sha256:<hex>`` of the sorted-key compact JSON of ``obj``."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
