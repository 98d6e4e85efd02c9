"""Process trees read from /proc (Linux): what tests that kill or outlive processes need."""

from __future__ import annotations

from pathlib import Path


def ppid_of(stat: str) -> int:
    """The parent pid in the text of a ``/proc/<pid>/stat`` file."""
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, theirs, ...)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                children.setdefault(ppid_of((d / "stat").read_text()), []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out
