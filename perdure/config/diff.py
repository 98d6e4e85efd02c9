"""Differences between two canonical configs (plain nested dicts), by dotted key."""

from __future__ import annotations

from typing import Any


def diff_canonical(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two canonical configs."""
    keys = sorted(set(a) | set(b))
    out: list[str] = []
    for k in keys:
        key = f"{prefix}.{k}" if prefix else k
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_canonical(va, vb, key)
        elif isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb):
            out += diff_canonical(_indexed(va), _indexed(vb), key)
        elif va != vb:
            out.append(key)
    return out


def _indexed(items: list[Any]) -> dict[str, Any]:
    return {str(i): v for i, v in enumerate(items)}
