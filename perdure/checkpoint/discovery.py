"""Finding checkpoints and pruning old ones.

A directory counts as a checkpoint only when its name is ``step-<digits>`` and it holds a
manifest: on a local file system a directory gets that name only after its manifest is
durable, so anything else (``.tmp-``, ``.old-``, a half-deleted directory) is debris.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path

from perdure.checkpoint import layout
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.errors import CheckpointError
from perdure.checkpoint.fsio import fsync_dir
from perdure.checkpoint.loader import verify_checkpoint

log = logging.getLogger(__name__)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoint directories under ``root`` (manifest present), oldest first.
    Their contents are not checked; see :func:`latest_checkpoint`."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        step = layout.step_of(p)
        if step is not None and _has_manifest(p):
            found.append((step, p))
    return [p for _, p in sorted(found)]


def _has_manifest(p: Path) -> bool:
    """Whether ``p`` holds a manifest; one that cannot even be looked at (permissions) is
    listed, so that reading it reports why instead of the listing failing or hiding it."""
    try:
        return (p / layout.MANIFEST).is_file()
    except OSError:
        return True


def latest_checkpoint(root: str | Path, *, verify: bool = True) -> Path | None:
    """The newest intact checkpoint, or None. One that is unreadable or breaks any rule of
    the format is skipped with a warning naming the bad file and the rule, and the search
    falls back to the next older one. ``verify`` checks every checksum (reads every
    byte); without it everything but the tensor files' CRCs is checked (manifest, sizes,
    headers, context)."""
    for p in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(p, checksums=verify)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}", stacklevel=2)
            continue
        return p
    return None


def retained(steps: list[int], config: CheckpointConfig, newest_intact: int | None) -> set[int]:
    """Steps to keep: the newest ``keep_last``, every ``keep_every``-th, the newest intact."""
    keep = set(sorted(steps)[-config.keep_last :]) if config.keep_last > 0 else set()
    if config.keep_every > 0:
        keep |= {s for s in steps if s % config.keep_every == 0}
    if newest_intact is not None:
        keep.add(newest_intact)
    return keep


def apply_retention(
    root: str | Path, config: CheckpointConfig, *, newest_intact: Path | None = None
) -> list[Path]:
    """Delete checkpoints not retained, and debris of crashed saves no newer than the newest
    committed one. ``newest_intact`` (the one just committed) is never deleted; when not
    given it is found with :func:`latest_checkpoint`. Returns the deleted paths.

    A checkpoint is uncommitted first (manifest removed, directory fsynced) and then
    deleted, so a crash half-way leaves debris, never a committed partial checkpoint."""
    root = Path(root)
    if newest_intact is None:
        newest_intact = latest_checkpoint(root)
    committed = list_checkpoints(root)
    steps = {layout.step_of(p): p for p in committed}
    intact = layout.step_of(newest_intact) if newest_intact is not None else None
    keep = retained([s for s in steps if s is not None], config, intact)
    deleted = []
    for s, p in steps.items():
        if s not in keep:
            _delete(p)
            deleted.append(p)
    newest = max((s for s in steps if s is not None), default=-1)
    for p in root.iterdir():
        if p.is_dir() and _is_debris(p, newest):
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


def _is_debris(p: Path, newest: int) -> bool:
    if layout.step_of(p) is not None:
        return not (p / layout.MANIFEST).exists() and layout.step_of(p) <= newest  # type: ignore[operator]
    name = p.name
    if not name.startswith("step-") or "." not in name:
        return False
    try:
        step = int(name[5 : name.index(".")])
    except ValueError:
        return False
    return step <= newest and (".tmp-" in name or ".old-" in name)


def _delete(p: Path) -> None:
    try:
        os.remove(p / layout.MANIFEST)
        fsync_dir(p)
    except FileNotFoundError:
        pass
    shutil.rmtree(p, ignore_errors=True)
    log.info("retention: deleted %s", p)
