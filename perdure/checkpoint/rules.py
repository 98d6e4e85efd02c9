"""The structural rules of a checkpoint (docs/checkpoint-format.md, sections 3 to 5),
checked before a tensor is allocated or a byte of tensor data is read.

Checksums catch corrupt bytes in the files they cover; these rules catch a manifest or a
context that parses but lies: chunk rows that skip or repeat rows, chunk keys swapped
between tensors, a dtype that would reinterpret the stored bytes, a shape larger than the
bytes behind it, a file name that leaves the checkpoint. With them, every field of a
manifest that shapes the loaded state is fixed by the files it lists, so a manifest edit
either breaks a rule or changes nothing loaded. They are pure functions of parsed JSON
and safetensors headers (no torch), so the loader, ``perdure ckpt verify`` and discovery
enforce one set of rules: the spec's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from perdure.checkpoint import layout
from perdure.checkpoint.errors import CorruptCheckpointError
from perdure.checkpoint.sfile import Entry

MODEL, OPTIMIZER = "model/", "optimizer/"
_CHECKSUM = re.compile(r"crc32:[0-9a-f]{8}")
_TOP: dict[str, type] = {"files": dict, "context": str, "tensors": dict}
CONTEXT_FIELDS: dict[str, type] = {
    "step": int,
    "optimizer": dict,
    "rng": dict,
    "data": dict,
    "config_hash": str,
    "canonical_config": dict,
    "topology": dict,
    "provenance": dict,
    "decisions": list,
}
"""The context's fields and their types, as JSON and once decoded from tagged JSON."""


@dataclass(frozen=True)
class ChunkSpec:
    """Rows ``[start, stop)`` of a tensor, stored in ``file`` under ``key`` (0-d: 0, 0)."""

    file: str
    key: str
    start: int
    stop: int


@dataclass(frozen=True)
class TensorSpec:
    """A tensor entry of the manifest that obeys every rule."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkSpec, ...]

    def chunk_shape(self, c: ChunkSpec) -> tuple[int, ...]:
        """The shape the safetensors header must give chunk ``c``."""
        return (c.stop - c.start, *self.shape[1:]) if self.shape else ()

    def chunk_key(self, c: ChunkSpec) -> str:
        """The key chunk ``c`` must have: the name for a tensor stored whole,
        ``name[start:stop]`` for each piece of a split one."""
        return self.name if len(self.chunks) == 1 else f"{self.name}[{c.start}:{c.stop}]"


Placements = dict[str, dict[str, tuple[TensorSpec, ChunkSpec]]]
"""``{file: {chunk key: (tensor, chunk)}}``: what each tensor file must hold."""


def is_count(v: Any) -> bool:
    """An int (not a bool) in ``[0, 2**53)``: every size, step, row and dimension."""
    return type(v) is int and 0 <= v < layout.MAX_COUNT


def check_plain_name(name: Any, where: str, what: str) -> str:
    """A file name of the manifest names a file directly inside the checkpoint: joined to
    the checkpoint's path it must not climb out (``..``), jump out (an absolute path),
    reach into a subdirectory, or be cut short by a NUL."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise CorruptCheckpointError(
            where, f"{what} {name!r} is not a plain file name (no '/', '\\', NUL, '.' or '..')"
        )
    if name == layout.MANIFEST:
        raise CorruptCheckpointError(where, f"{what} {name!r}: the manifest cannot list itself")
    return name


def check_manifest(m: dict[str, Any], where: str, dir_step: int | None) -> dict[str, TensorSpec]:
    """Every structural rule of a parsed manifest; returns its tensors. ``dir_step`` is
    the step in the directory's name (None when the directory is not named ``step-N``)."""
    if not is_count(m.get("step")):
        raise CorruptCheckpointError(
            where, f"field 'step' must be an int >= 0 (got {m.get('step')!r})"
        )
    for key, tp in _TOP.items():
        if not isinstance(m.get(key), tp):
            raise CorruptCheckpointError(where, f"field {key!r} is missing or not a {tp.__name__}")
    if dir_step is not None and m["step"] != dir_step:
        raise CorruptCheckpointError(
            where, f"step {m['step']} disagrees with the directory name (step {dir_step})"
        )
    check_files(m["files"], where)
    context = check_plain_name(m["context"], where, "context file")
    if context not in m["files"]:
        raise CorruptCheckpointError(where, f"context file {context!r} is not listed in 'files'")
    specs = tensor_specs(m, where)
    if context in placements(specs):
        raise CorruptCheckpointError(where, f"context file {context!r} also holds tensor chunks")
    return specs


def check_files(files: dict[str, Any], where: str) -> None:
    """Each listed file: a plain name, a byte count and a ``crc32:<8 hex>`` checksum."""
    for name, rec in files.items():
        check_plain_name(name, where, "listed file")
        if not isinstance(rec, dict) or not is_count(rec.get("bytes")):
            raise CorruptCheckpointError(
                where, f"files[{name!r}]: 'bytes' must be an int in [0, 2**53) (got {rec!r:.80})"
            )
        checksum = rec.get("checksum")
        if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
            raise CorruptCheckpointError(
                where,
                f"files[{name!r}]: checksum {checksum!r:.80} is not 'crc32:<8 lower-case hex>'",
            )


def tensor_specs(m: dict[str, Any], where: str) -> dict[str, TensorSpec]:
    """The tensor entries of a manifest whose top-level fields are checked, in order."""
    specs = {name: _tensor_spec(name, e, m["files"], where) for name, e in m["tensors"].items()}
    placements(specs, where)
    return specs


def _tensor_spec(name: str, entry: Any, files: dict[str, Any], where: str) -> TensorSpec:
    what = f"tensor {name!r}"
    if not name.startswith((MODEL, OPTIMIZER)) or name in (MODEL, OPTIMIZER):
        raise CorruptCheckpointError(where, f"{what}: names start with 'model/' or 'optimizer/'")
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(where, f"{what}: entry is not a JSON object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in layout.DTYPE_SIZES:
        raise CorruptCheckpointError(
            where, f"{what}: dtype {dtype!r:.40} is not one of {sorted(layout.DTYPE_SIZES)}"
        )
    shape = _shape(entry.get("shape"), dtype, where, what)
    raw = entry.get("chunks")
    if not isinstance(raw, list) or not raw:
        raise CorruptCheckpointError(where, f"{what}: 'chunks' must list at least one chunk")
    chunks = tuple(_chunk(c, f"{what} chunk {i}", files, shape, where) for i, c in enumerate(raw))
    spec = TensorSpec(name, dtype, shape, chunks)
    _check_cover(spec, where)
    for i, c in enumerate(chunks):
        if c.key != spec.chunk_key(c):
            raise CorruptCheckpointError(
                where, f"{what} chunk {i}: key {c.key!r} should be {spec.chunk_key(c)!r}"
            )
    return spec


def _shape(raw: Any, dtype: str, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(is_count(d) for d in raw):
        raise CorruptCheckpointError(
            where, f"{what}: shape {raw!r:.80} is not a list of ints in [0, 2**53)"
        )
    span = layout.DTYPE_SIZES[dtype]
    for d in raw:
        span *= max(d, 1)
    if span >= layout.MAX_COUNT:
        raise CorruptCheckpointError(
            where, f"{what}: {dtype} {raw} spans {span} bytes, more than 2**53"
        )
    return tuple(raw)


def _chunk(
    c: Any, what: str, files: dict[str, Any], shape: tuple[int, ...], where: str
) -> ChunkSpec:
    if not isinstance(c, dict):
        raise CorruptCheckpointError(where, f"{what} is not a JSON object")
    file = check_plain_name(c.get("file"), where, f"{what}: file")
    if file not in files:
        raise CorruptCheckpointError(where, f"{what}: file {file!r} is not listed in 'files'")
    key, rows = c.get("key"), c.get("rows")
    if not isinstance(key, str):
        raise CorruptCheckpointError(where, f"{what}: key {key!r:.80} is not a string")
    if not shape:
        if rows is not None:
            raise CorruptCheckpointError(where, f"{what}: a 0-d tensor's chunk has rows null")
        return ChunkSpec(file, key, 0, 0)
    if not (isinstance(rows, list) and len(rows) == 2 and all(is_count(r) for r in rows)):
        raise CorruptCheckpointError(where, f"{what}: rows {rows!r:.80} is not [start, stop]")
    return ChunkSpec(file, key, rows[0], rows[1])


def _check_cover(spec: TensorSpec, where: str) -> None:
    """Chunks are sorted by start, non-empty, back to back and cover ``[0, shape[0])``:
    every row exactly once, so nothing is read twice and nothing left unread."""
    what = f"tensor {spec.name!r}"
    if not spec.shape:
        if len(spec.chunks) != 1:
            raise CorruptCheckpointError(where, f"{what}: a 0-d tensor has exactly one chunk")
        return
    rows, pos = spec.shape[0], 0
    lone_empty = rows == 0 and len(spec.chunks) == 1
    for i, c in enumerate(spec.chunks):
        if c.start != pos:
            raise CorruptCheckpointError(
                where,
                f"{what} chunk {i}: rows [{c.start}, {c.stop}) start at {c.start}, expected "
                f"{pos} (chunks cover rows [0, {rows}) in order, each row exactly once)",
            )
        if c.stop <= c.start and not lone_empty:
            raise CorruptCheckpointError(
                where, f"{what} chunk {i}: rows [{c.start}, {c.stop}) are empty"
            )
        pos = c.stop
    if pos != rows:
        raise CorruptCheckpointError(
            where, f"{what}: chunks cover rows [0, {pos}), the shape has {rows} rows"
        )


def placements(specs: Mapping[str, TensorSpec], where: str = "") -> Placements:
    """Which chunk each tensor file holds under which key; no key twice in one file."""
    out: Placements = {}
    for spec in specs.values():
        for c in spec.chunks:
            held = out.setdefault(c.file, {})
            if c.key in held:
                raise CorruptCheckpointError(
                    where, f"file {c.file!r} key {c.key!r} is claimed by two chunks"
                )
            held[c.key] = (spec, c)
    return out


def check_header(
    where: str, entries: Mapping[str, Entry], held: Mapping[str, tuple[TensorSpec, ChunkSpec]]
) -> None:
    """A tensor file's safetensors header holds exactly the manifest's chunks for it, each
    with the manifest's dtype (the same name: bytes are never reinterpreted) and shape.
    With the header's own checks (offsets inside the file) this bounds every tensor by
    the bytes on disk before anything is allocated."""
    missing = sorted(set(held) - set(entries))
    extra = sorted(set(entries) - set(held))
    if missing or extra:
        raise CorruptCheckpointError(
            where,
            f"header and manifest disagree: chunks {missing[:5]} are not in the header, "
            f"header keys {extra[:5]} are not in the manifest",
        )
    for key, (spec, c) in held.items():
        e, want = entries[key], spec.chunk_shape(c)
        if e.dtype != spec.dtype or e.shape != want:
            raise CorruptCheckpointError(
                where,
                f"{key!r} is stored as {e.dtype} {list(e.shape)}, the manifest says "
                f"{spec.dtype} {list(want)}",
            )


def check_context(
    ctx: dict[str, Any], step: int, specs: Mapping[str, TensorSpec], where: str
) -> None:
    """The context has every field with its JSON type, the manifest's step, and its
    optimizer references every ``optimizer/`` tensor exactly once and nothing else."""
    for key, tp in CONTEXT_FIELDS.items():
        value = ctx.get(key)
        if not isinstance(value, tp) or (tp is int and type(value) is not int):
            raise CorruptCheckpointError(where, f"field {key!r} is missing or not a {tp.__name__}")
    if ctx["step"] != step:
        raise CorruptCheckpointError(
            where, f"step {ctx['step']} disagrees with the manifest's {step}"
        )
    refs = sorted(_tensor_refs(ctx["optimizer"], where))
    stored = sorted(n for n in specs if n.startswith(OPTIMIZER))
    if refs != stored:
        unknown = sorted(set(refs) - set(stored))[:3]
        unused = sorted(set(stored) - set(refs))[:3]
        twice = sorted({r for r in refs if refs.count(r) > 1})[:3]
        raise CorruptCheckpointError(
            where,
            f"optimizer tensors: references to unknown {unknown}, unreferenced {unused}, "
            f"referenced twice {twice} (each optimizer/ tensor is referenced exactly once)",
        )


def _tensor_refs(value: Any, where: str) -> Iterator[str]:
    """Names in ``{"$tensor": name}`` anywhere in ``value`` (iterative: any depth)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            if len(v) == 1 and "$tensor" in v:
                if not isinstance(v["$tensor"], str):
                    raise CorruptCheckpointError(
                        where, f"$tensor {v['$tensor']!r:.40} is not a name"
                    )
                yield v["$tensor"]
            else:
                stack.extend(v.values())
