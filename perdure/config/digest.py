"""The config hash of a canonical config (plain nested data): one definition for the run
config, which computes it, and the checkpoint loader, which compares it."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_text(canon: dict[str, Any]) -> str:
    """The canonical config as compact JSON with sorted keys: what is hashed."""
    return json.dumps(canon, sort_keys=True, separators=(",", ":"))


def hash_canonical(canon: dict[str, Any]) -> str:
    """``sha256:<hex>`` of :func:`canonical_text`."""
    return "sha256:" + hashlib.sha256(canonical_text(canon).encode()).hexdigest()
