"""The synchronous save: part files, context, manifest, commit.

Commit protocol (local file system), for W writers holding identical replicas (or one
sharded state, each shard on some of them: ``plan``'s holders):

1. The writers agree on a temporary directory ``step-N.tmp-<token>``: W = 1 draws the
   token; W > 1 all-gathers every rank's draw and takes rank 0's.
2. Each rank writes its part file (its 1/W of the tensor bytes, see ``plan``), computing
   the CRC on threads from the same memory, and fsyncs it; rank 0 also writes
   ``context.json``. Each rank all-gathers ``{file, bytes, checksum}`` or its error.
3. Rank 0, when every part is durable and no rank failed, writes ``manifest.json``
   (temporary name, fsync, rename, directory fsync), renames the directory to ``step-N``
   and fsyncs the root. A last all-gather tells the other ranks that the commit happened.

A crash before the rename leaves only a ``.tmp-`` directory, which readers ignore and
retention removes; a save that fails (a full disk, a refused commit) removes its own at
once. The older checkpoints are never touched before the commit.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint import codec, crc, layout
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.crc import checksum_pool
from perdure.checkpoint.discovery import apply_retention
from perdure.checkpoint.errors import CheckpointSaveError
from perdure.checkpoint.fsio import fsync_dir, write_all, write_durable
from perdure.checkpoint.hooks import crash_point
from perdure.checkpoint.manifest import encode_manifest
from perdure.checkpoint.plan import Chunk, plan_parts
from perdure.checkpoint.sfile import build_header
from perdure.checkpoint.state import CheckpointState
from perdure.checkpoint.tensors import ITEMSIZE, byte_view, flatten, meta_of, to_cpu_contiguous

Exchange = Callable[[dict[str, Any]], list[dict[str, Any]]]
"""All-gather of JSON-able dicts over the W writers, in rank order. Every payload has a
``round`` key (e.g. ``step-1200/parts``), unique per collective; an implementation must
pair the calls of the W ranks by it, because it may be called from several threads."""


@dataclass
class Prepared:
    """A state ready to write: named contiguous CPU tensors and the context as JSON."""

    step: int
    tensors: dict[str, torch.Tensor]
    """Every tensor of the state; one this writer does not hold is a ``meta`` tensor (its
    dtype and shape only: a sharded state's other shards, see ``plan.plan_parts``)."""
    context: dict[str, Any]
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """For a tensor that not every writer holds: the ranks that hold it."""


def context_of(state: CheckpointState, optimizer_structure: Any) -> dict[str, Any]:
    """The JSON context file's content (tagged JSON, see ``codec``)."""
    return {
        "step": int(state.step),
        "optimizer": optimizer_structure,
        "rng": codec.encode(state.rng),
        "data": codec.encode(state.data),
        "config_hash": state.config_hash,
        "canonical_config": codec.encode(state.canonical_config),
        "topology": codec.encode(state.topology),
        "provenance": codec.encode(state.provenance),
        "decisions": codec.encode(state.decisions),
    }


def prepare(state: CheckpointState, holders: dict[str, tuple[int, ...]] | None = None) -> Prepared:
    """Flatten a state for writing (copies only device or non-contiguous tensors; a
    ``meta`` tensor, one this writer does not hold, stays as it is)."""
    tensors, structure = flatten(state.model, state.optimizer)
    cpu = {k: t if t.is_meta else to_cpu_contiguous(t) for k, t in tensors.items()}
    return Prepared(int(state.step), cpu, context_of(state, structure), dict(holders or {}))


def save_checkpoint(
    root: str | Path,
    state: CheckpointState,
    *,
    rank: int = 0,
    world: int = 1,
    exchange: Exchange | None = None,
    retention: CheckpointConfig | None = None,
    holders: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """Write ``ROOT/step-<step>/`` atomically and return its path (see module doc).

    With ``world > 1`` every rank must call this with the same state and an ``exchange``
    over the same W ranks; ``retention`` (rank 0 only) prunes old ones. The same state:
    equal tensors, except those ``holders`` gives to some ranks only, which the others
    pass as ``meta`` tensors of the same dtype and shape (a sharded optimizer state).
    """
    prep = prepare(state, holders)
    return write_checkpoint(
        Path(root), prep, rank=rank, world=world, exchange=exchange, retention=retention
    )


def write_checkpoint(
    root: Path,
    prep: Prepared,
    *,
    rank: int = 0,
    world: int = 1,
    exchange: Exchange | None = None,
    retention: CheckpointConfig | None = None,
    before_commit: Callable[[], None] | None = None,
    after_failure: Callable[[str], None] | None = None,
    attempt: int = 0,
) -> Path:
    """``before_commit`` runs on rank 0 right before the rename that commits; an
    exception from it fails the save on every rank, leaving nothing
    (the temporary directory is removed). ``after_failure`` runs on rank 0 once a failed
    save's files are gone, with the ranks' errors, before any rank returns (the saver
    makes room there when the disk was full). ``attempt``: how many saves of this step
    the same writers tried before (their exchange rounds must not meet this one's)."""
    if world > 1 and exchange is None:
        raise ValueError(f"save of step {prep.step}: world={world} needs an exchange")
    if not 0 <= rank < world:
        raise ValueError(f"save of step {prep.step}: rank {rank} not in [0, {world})")

    def gather(phase: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        if exchange is None or world == 1:
            return [payload]
        tag = f"step-{prep.step}" + (f".{attempt}" if attempt else "")
        return exchange({"round": f"{tag}/{phase}", **payload})

    root.mkdir(parents=True, exist_ok=True)
    token = gather("token", {"rank": rank, "token": secrets.token_hex(6)})[0]["token"]
    tmp = root / layout.tmp_dir_name(prep.step, token)
    tmp.mkdir(exist_ok=True)
    crash_point("before_write")
    metas = [meta_of(k, t) for k, t in prep.tensors.items()]
    parts = plan_parts(metas, world, prep.holders)
    own_error: BaseException | None = None
    try:
        _check_held(parts[rank], prep, rank)
        files = [write_part(tmp, layout.part_file_name(rank, world), parts[rank], prep.tensors)]
        if rank == 0:
            files.append(_write_json(tmp, layout.CONTEXT, prep.context))
        fsync_dir(tmp)
        payload: dict[str, Any] = {"rank": rank, "files": files, "error": None}
    except Exception as e:
        own_error = e
        payload = {"rank": rank, "files": [], "error": f"{type(e).__name__}: {e}"}
    gathered = gather("parts", payload)
    if any(g.get("error") for g in gathered):
        _discard(tmp, layout.part_file_name(rank, world), rank)
        if rank == 0 and after_failure is not None:
            after_failure(_error_text(gathered))
        gather("discarded", {"rank": rank})  # nobody retries before rank 0 made room
    _raise_errors(gathered, prep.step, own_error, "writing its part")
    final = root / layout.step_dir_name(prep.step)
    status: dict[str, Any] = {"rank": rank, "error": None}
    if rank == 0:
        try:
            _commit(root, tmp, final, prep, parts, gathered, world, before_commit)
        except Exception as e:
            own_error = e
            status["error"] = f"{type(e).__name__}: {e}"
            _discard(tmp, layout.part_file_name(rank, world), rank)
            if after_failure is not None:
                after_failure(str(status["error"]))
    _raise_errors(gather("commit", status), prep.step, own_error, "committing")
    if rank == 0 and retention is not None:
        apply_retention(root, retention, newest_intact=final)
    return final


def _discard(tmp: Path, part: str, rank: int) -> None:
    """A failed save's files: each rank deletes its own part, rank 0 the directory (every
    rank has stopped writing into it once the failure is gathered). A full disk gets its
    bytes back at once, instead of at the next retention."""
    with contextlib.suppress(OSError):
        os.unlink(tmp / part)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_held(chunks: list[Chunk], prep: Prepared, rank: int) -> None:
    """Every chunk a rank must write is one it holds (the holders it was given are right)."""
    missing = [c.meta.key for c in chunks if prep.tensors[c.meta.key].is_meta]
    if missing:
        raise ValueError(
            f"rank {rank} must write {', '.join(missing[:4])} but does not hold "
            f"{'them' if len(missing) > 1 else 'it'} (the holders passed to the save are wrong)"
        )


def _error_text(gathered: list[dict[str, Any]]) -> str:
    return "; ".join(f"rank {g['rank']}: {g['error']}" for g in gathered if g.get("error"))


def _raise_errors(
    gathered: list[dict[str, Any]], step: int, own: BaseException | None, what: str
) -> None:
    bad = [g for g in gathered if g.get("error")]
    if bad:
        lines = "; ".join(f"rank {g['rank']}: {g['error']}" for g in bad)
        raise CheckpointSaveError(f"save of step {step} failed while {what}: {lines}") from own


def write_part(
    dirpath: Path, name: str, chunks: list[Chunk], tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Write one safetensors file straight from tensor memory, CRC on threads; fsync it."""
    entries, segments = [], []
    # Widest dtypes first, so every chunk starts aligned to its element size and a loader
    # can map the file and view its bytes as tensors without copying.
    for c in sorted(chunks, key=lambda c: -ITEMSIZE[c.meta.dtype]):
        a, b = c.byte_range
        entries.append((c.file_key, c.meta.dtype, c.shape, b - a))
        segments.append(byte_view(tensors[c.meta.key])[a:b])
    header = build_header(entries)
    pool = checksum_pool()
    futures = []
    size = 0
    with open(dirpath / name, "wb", buffering=0) as f:
        for block in crc.blocks([memoryview(header), *segments]):
            futures.append(pool.submit(crc.crc_block, block))
            for mv in block:
                write_all(f, mv)
                size += len(mv)
                if size == len(header):
                    crash_point("during_write")
        os.fsync(f.fileno())
    return {
        "file": name,
        "bytes": size,
        "checksum": "crc32:" + crc.format_crc(crc.join_futures(futures)),
    }


def _write_json(dirpath: Path, name: str, obj: Any) -> dict[str, Any]:
    data = (codec_dumps(obj) + "\n").encode()
    write_durable(dirpath / name, data)
    return {
        "file": name,
        "bytes": len(data),
        "checksum": "crc32:" + crc.format_crc(zlib.crc32(data)),
    }


def codec_dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def manifest_of(
    prep: Prepared, parts: list[list[Chunk]], files: list[dict[str, Any]], world: int
) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for c in sorted((c for p in parts for c in p), key=lambda c: (c.meta.key, c.start)):
        t = tensors.setdefault(
            c.meta.key, {"dtype": c.meta.dtype, "shape": list(c.meta.shape), "chunks": []}
        )
        rows = [c.start, c.stop] if c.meta.shape else None
        t["chunks"].append(
            {"file": layout.part_file_name(c.rank, world), "key": c.file_key, "rows": rows}
        )
    order = {k: i for i, k in enumerate(prep.tensors)}
    ctx = prep.context
    return {
        "format": layout.FORMAT_NAME,
        "version": {"major": layout.FORMAT_MAJOR, "minor": layout.FORMAT_MINOR},
        "step": prep.step,
        "created_unix": time.time(),
        "writers": world,
        "files": {f["file"]: {"bytes": f["bytes"], "checksum": f["checksum"]} for f in files},
        "context": layout.CONTEXT,
        "tensors": dict(sorted(tensors.items(), key=lambda kv: order[kv[0]])),
        "summary": {
            "config_hash": ctx["config_hash"],
            "commit": codec.decode(ctx["provenance"]).get("sha"),
            "tensor_bytes": sum(m.nbytes for m in (meta_of(k, t) for k, t in prep.tensors.items())),
        },
    }


def _commit(
    root: Path,
    tmp: Path,
    final: Path,
    prep: Prepared,
    parts: list[list[Chunk]],
    gathered: list[dict[str, Any]],
    world: int,
    before_commit: Callable[[], None] | None = None,
) -> None:
    files = [f for g in gathered for f in g["files"]]
    crash_point("before_manifest")
    manifest = manifest_of(prep, parts, files, world)
    write_durable(tmp / (layout.MANIFEST + ".tmp"), encode_manifest(manifest))
    os.replace(tmp / (layout.MANIFEST + ".tmp"), tmp / layout.MANIFEST)
    fsync_dir(tmp)
    crash_point("after_manifest")
    if before_commit is not None:
        before_commit()  # e.g. the fence: a stale writer's save stays uncommitted
    old = None
    if final.exists():
        # Re-saving a step (a resumed run): move the old one aside, swap, then delete it.
        old = root / f"{final.name}.old-{secrets.token_hex(6)}"
        os.replace(final, old)
    os.replace(tmp, final)
    crash_point("after_rename")
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
