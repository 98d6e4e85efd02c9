"""Mutations of a real checkpoint, and the oracle that judges each reader's answer.

Shared by ``tests/unit/test_checkpoint_fuzz.py`` (hypothesis, bounded, in CI) and
``benchmarks/fuzz_checkpoint.py`` (a seeded run of many inputs, for the counts in reports).

The oracle: each reader (the loader with and without mmap, ``verify_checkpoint``, the
reference reader) either raises the format's own error or returns state bitwise identical
to the original. A mutation touches one place (a file's bytes, one manifest field, one
context or header edit) and may then fix what a writer would: the manifest's seal, or a
file's listed size and CRC. It never rewrites several files consistently, since that is a
different checkpoint, not a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    state_digest,
    verify_checkpoint,
)
from perdure.checkpoint import reference_reader as rr
from perdure.checkpoint.errors import LegacyManifestWarning
from perdure.checkpoint.layout import DTYPE_SIZES
from perdure.checkpoint.manifest import SEAL_BYTES, SEAL_KEY, seal_line
from perdure.checkpoint.rules import CONTEXT_FIELDS
from tests.checkpoint_support import make_state, save_split

MANIFEST = "manifest.json"
FIELDS = ("step", *(k for k in CONTEXT_FIELDS if k not in ("step", "optimizer")))
Rnd = random.Random


# --- the original and the oracle --------------------------------------------------------


def build_bases(root: Path) -> list[Path]:
    """Two small real checkpoints: one writer, and two writers (with a split tensor)."""
    return [
        save_checkpoint(root / "one-writer", make_state(step=7)),
        save_split(root / "two-writers", make_state(step=7), world=2),
    ]


def _loader(mmap: bool) -> Callable[[Path], str]:
    def check(path: Path) -> str:
        loaded = load_checkpoint(path, mmap=mmap)
        rest = {k: getattr(loaded, k) for k in FIELDS}
        return state_digest(loaded.model, loaded.optimizer) + repr(rest)

    return check


def _verify(path: Path) -> str:
    verify_checkpoint(path)
    return "ok"


def _reader(path: Path) -> str:
    ckpt = rr.Checkpoint(path)
    h = hashlib.sha256()
    for name in sorted(ckpt.tensor_names()):
        a = ckpt.tensor(name, bf16="bits")
        dtype = ckpt.manifest["tensors"][name]["dtype"]
        h.update(repr((name, dtype, a.dtype.str, a.shape)).encode() + a.tobytes())
    ctx = ckpt.context()
    h.update(repr({k: ctx[k] for k in CONTEXT_FIELDS}).encode())
    return h.hexdigest()


CHECKS: dict[str, tuple[Callable[[Path], str], type[Exception]]] = {
    "load": (_loader(True), CheckpointError),
    "load_no_mmap": (_loader(False), CheckpointError),
    "verify": (_verify, CheckpointError),
    "reader": (_reader, rr.ReaderError),
}


def run_checks(path: Path) -> dict[str, tuple[str, str]]:
    """``{check: (outcome, detail)}``: outcome ``error`` (the format's own), ``traceback``
    (anything else), or the loaded state's fingerprint."""
    out = {}
    for name, (check, error) in CHECKS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LegacyManifestWarning)
            warnings.simplefilter("ignore", rr.LegacyManifestWarning)
            try:
                out[name] = ("ok", check(path))
            except error as e:
                out[name] = ("error", str(e))
            except Exception as e:
                out[name] = ("traceback", f"{type(e).__name__}: {e}")
    return out


VERDICTS = ("clean error", "identical", "traceback", "silent load", "disagreement")


def verdict(outcomes: dict[str, str]) -> str:
    """One input's verdict over every check's outcome (worst first)."""
    kinds = set(outcomes.values())
    if "traceback" in kinds:
        return "traceback"
    if "changed" in kinds:
        return "silent load"
    if len(kinds) > 1:
        return "disagreement"
    return "clean error" if kinds == {"error"} else "identical"


@dataclass
class Tally:
    """Counts over inputs: each input is one mutated checkpoint, judged by every check."""

    verdicts: Counter[str] = field(default_factory=Counter)
    per_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    per_check: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def inputs(self) -> int:
        return sum(self.verdicts.values())

    def add(
        self, kind: str, what: str, got: dict[str, tuple[str, str]], want: dict[str, str]
    ) -> list[str]:
        """Record one input; returns what was wrong with it (empty: nothing)."""
        outcomes = {name: _outcome(g, want[name]) for name, g in got.items()}
        v = verdict(outcomes)
        self.verdicts[v] += 1
        self.per_kind[kind, v] += 1
        for name, o in outcomes.items():
            self.per_check[f"{name}: {o}"] += 1
        if v in ("clean error", "identical"):
            return []
        bad = [f"{n} {o}: {got[n][1][:300]}" for n, o in outcomes.items() if o != "same"]
        self.failures.append(f"{kind}: {what}: {v}: " + "; ".join(bad))
        return bad

    def summary(self) -> str:
        c = self.verdicts
        return (
            f"checkpoint fuzz: {self.inputs} inputs tried, {c['clean error']} clean errors, "
            f"{c['identical']} loaded identical, {c['traceback']} tracebacks, "
            f"{c['silent load']} silent loads with changed state, "
            f"{c['disagreement']} disagreements between checks"
        )


TALLY = Tally()
"""The counts of this test session's fuzz tests (printed in pytest's terminal summary)."""


def _outcome(got: tuple[str, str], want: str) -> str:
    kind, value = got
    if kind != "ok":
        return kind
    return "same" if value == want else "changed"


def expected(base: Path) -> dict[str, str]:
    got = run_checks(base)
    assert all(k == "ok" for k, _ in got.values()), got
    return {name: value for name, (_, value) in got.items()}


# --- helpers on files -------------------------------------------------------------------


def tensor_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_bytes())  # type: ignore[no-any-return]


def manifest_prefix(ckpt: Path) -> bytes:
    """The manifest's bytes without its seal (the part a seal covers)."""
    data = (ckpt / MANIFEST).read_bytes()
    return data[:-SEAL_BYTES]


def write_sealed_prefix(ckpt: Path, prefix: bytes) -> None:
    (ckpt / MANIFEST).write_bytes(prefix + seal_line(prefix))


def write_manifest(ckpt: Path, m: dict[str, Any], *, seal: bool, rnd: Rnd | None = None) -> None:
    """Write ``m`` as a writer would (sealed), or as plain JSON without a seal."""
    m = {k: v for k, v in m.items() if k != SEAL_KEY}
    indent = None if rnd is None else rnd.choice([None, 1, 2, "\t"])
    body = json.dumps(m, indent=1 if seal else indent)
    if not seal:
        (ckpt / MANIFEST).write_text(body + ("\n" if rnd and rnd.random() < 0.5 else ""))
        return
    prefix = (body[:-2] + ",\n").encode()
    write_sealed_prefix(ckpt, prefix)


def fix_listing(ckpt: Path, name: str) -> None:
    """List file ``name`` with its current size and CRC (as a writer would) and reseal."""
    data = (ckpt / name).read_bytes()
    m = read_json(ckpt / MANIFEST)
    m["files"][name] = {"bytes": len(data), "checksum": f"crc32:{zlib.crc32(data):08x}"}
    write_manifest(ckpt, m, seal=True)


def flip_bits(data: bytes, rnd: Rnd, lo: int = 0) -> bytes:
    out = bytearray(data)
    for _ in range(rnd.randint(1, 3)):
        i = rnd.randrange(lo, len(out))
        out[i] ^= 1 << rnd.randrange(8)
    return bytes(out)


def _digit_flip(data: bytes, rnd: Rnd) -> tuple[bytes, str]:
    digits = [i for i, b in enumerate(data) if 48 <= b <= 57]
    i = rnd.choice(digits)
    new = rnd.choice([d for d in b"0123456789" if d != data[i]])
    return data[:i] + bytes([new]) + data[i + 1 :], f"byte {i}: {chr(data[i])} -> {chr(new)}"


# --- raw corruption: must always be refused --------------------------------------------


def m_flip(ckpt: Path, rnd: Rnd) -> str:
    f = rnd.choice(sorted(ckpt.iterdir()))
    f.write_bytes(flip_bits(f.read_bytes(), rnd))
    return f"bit flips in {f.name}"


def m_truncate(ckpt: Path, rnd: Rnd) -> str:
    f = rnd.choice(sorted(ckpt.iterdir()))
    data = f.read_bytes()
    n = rnd.randrange(len(data))
    f.write_bytes(data[:n])
    return f"{f.name} truncated to {n} of {len(data)} bytes"


def m_extend(ckpt: Path, rnd: Rnd) -> str:
    f = rnd.choice(sorted(ckpt.iterdir()))
    f.write_bytes(f.read_bytes() + rnd.choice([b"\n", b" ", b"\x00", b"\xff\xfe", b"{}"]))
    return f"bytes appended to {f.name}"


def m_digit(ckpt: Path, rnd: Rnd) -> str:
    data, what = _digit_flip((ckpt / MANIFEST).read_bytes(), rnd)
    (ckpt / MANIFEST).write_bytes(data)
    return f"manifest digit {what} (seal kept)"


def m_digit_resealed(ckpt: Path, rnd: Rnd) -> str:
    data, what = _digit_flip(manifest_prefix(ckpt), rnd)
    write_sealed_prefix(ckpt, data)
    return f"manifest digit {what}, resealed"


def m_raw_manifest_resealed(ckpt: Path, rnd: Rnd) -> str:
    """Byte-level damage to the manifest text, resealed: non-UTF-8 bytes, NUL, a BOM,
    duplicated keys, NaN, overflowing numbers, deep nesting, bit flips."""
    prefix = manifest_prefix(ckpt)
    i = rnd.randrange(1, len(prefix) - 1)
    edits: list[tuple[str, bytes]] = [
        ("non-UTF-8 byte", prefix[:i] + b"\xff" + prefix[i:]),
        ("invalid UTF-8 sequence", prefix[:i] + b"\xc3\x28" + prefix[i:]),
        ("NUL byte", prefix[:i] + b"\x00" + prefix[i:]),
        ("UTF-8 BOM", b"\xef\xbb\xbf" + prefix),
        ("duplicate step", b'{\n "step": 8,' + prefix[1:]),
        ("duplicate tensors", b'{\n "tensors": {},' + prefix[1:]),
        ("NaN value", b'{\n "nan_field": NaN,' + prefix[1:]),
        ("overflowing number", b'{\n "big": 1e999,' + prefix[1:]),
        ("huge int", b'{\n "big": ' + b"9" * 5000 + b"," + prefix[1:]),
        ("deep nesting", b'{\n "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"," + prefix[1:]),
        ("bit flips", flip_bits(prefix, rnd)),
    ]
    what, data = rnd.choice(edits)
    write_sealed_prefix(ckpt, data)
    return f"manifest {what} at {i}, resealed"


# --- manifest field edits -------------------------------------------------------------


def _tensor(m: dict[str, Any], rnd: Rnd, shaped: bool = False) -> tuple[str, dict[str, Any]]:
    names = [n for n, t in m["tensors"].items() if t["shape"] or not shaped]
    name = rnd.choice(names)
    return name, m["tensors"][name]


def e_rows(m: dict[str, Any], rnd: Rnd) -> str:
    split = [n for n, t in m["tensors"].items() if len(t["chunks"]) > 1]
    name = rnd.choice(split) if split and rnd.random() < 0.6 else _tensor(m, rnd, True)[0]
    chunks = m["tensors"][name]["chunks"]
    i = rnd.randrange(len(chunks))
    a, b = chunks[i]["rows"]
    new = rnd.choice(
        [
            [0, b - a], [a, b + 1], [max(a - 1, 0), b], [b, a], [a, a], None, [a], [a, b, b],
            [str(a), b], [a, b + 10**9], [-1, b], [a + 1, b + 1], [float(a), b], [True, b],
            [a, 1e9], {"start": a},
        ]
    )  # fmt: skip
    chunks[i]["rows"] = new
    return f"{name} chunk {i} rows {[a, b]} -> {new}"


def e_swap_keys(m: dict[str, Any], rnd: Rnd) -> str:
    (a, ta), (b, tb) = rnd.sample(list(m["tensors"].items()), 2)
    same = [
        n
        for n, t in m["tensors"].items()
        if n != a and t["shape"] == ta["shape"] and t["dtype"] == ta["dtype"]
    ]
    if same and rnd.random() < 0.7:
        b = rnd.choice(same)
        tb = m["tensors"][b]
    what = rnd.choice(["key", "chunks"])
    if what == "key":
        ca, cb = ta["chunks"][0], tb["chunks"][0]
        ca["key"], cb["key"] = cb["key"], ca["key"]
    else:
        ta["chunks"], tb["chunks"] = tb["chunks"], ta["chunks"]
    return f"swap {what} of {a} and {b}"


def e_swap_files(m: dict[str, Any], rnd: Rnd) -> str:
    chunks = [c for t in m["tensors"].values() for c in t["chunks"]]
    x, y = rnd.sample(chunks, 2)
    x["file"], y["file"] = y["file"], x["file"]
    return f"swap files of chunks {x['key']} and {y['key']}"


def e_dtype(m: dict[str, Any], rnd: Rnd) -> str:
    name, t = _tensor(m, rnd)
    new = rnd.choice([*DTYPE_SIZES, "F33", "", None, 4, "f32", ["F32"]])
    old, t["dtype"] = t["dtype"], new
    return f"{name} dtype {old} -> {new!r}"


def e_shape(m: dict[str, Any], rnd: Rnd) -> str:
    name, t = _tensor(m, rnd)
    s = list(t["shape"])
    options: list[Any] = [
        [*s, 1], s[:-1], [1e9], [10**9], [-1], [True], [2**53], [2**40, 2**40], "16", None,
        [d + 1 for d in s], [max(d - 1, 0) for d in s], list(reversed(s)), [*s, 0],
    ]  # fmt: skip
    new = rnd.choice(options)
    t["shape"] = new
    if new in ([1e9], [10**9]) and rnd.random() < 0.5:
        t["chunks"] = []
        return f"{name} shape {s} -> {new!r}, no chunks"
    return f"{name} shape {s} -> {new!r}"


def e_chunks(m: dict[str, Any], rnd: Rnd) -> str:
    name, t = _tensor(m, rnd)
    cs = t["chunks"]
    what = rnd.choice(["empty", "duplicate", "drop", "reverse", "null", "extra", "not-a-list"])
    if what == "empty":
        t["chunks"] = []
    elif what == "duplicate":
        cs.append(dict(cs[-1]))
    elif what == "drop":
        cs.pop(rnd.randrange(len(cs)))
    elif what == "reverse":
        cs.reverse()
    elif what == "null":
        t["chunks"] = None
    elif what == "extra":
        cs.append({"file": cs[0]["file"], "key": "bogus", "rows": [0, 1]})
    else:
        t["chunks"] = {"0": cs[0]}
    return f"{name} chunks: {what}"


OUTSIDE = "outside-copy"


def e_filename(m: dict[str, Any], rnd: Rnd, ckpt: Path) -> str:
    """A name leaving the checkpoint, including one whose bytes, size and CRC match."""
    where = rnd.choice(["chunk", "files", "context"])
    if where == "chunk":
        _, t = _tensor(m, rnd)
        old = t["chunks"][0]["file"]
    else:
        old = m["context"] if where == "context" else rnd.choice(sorted(m["files"]))
    outside = ckpt.parent / f"{OUTSIDE}-{old}"
    shutil.copyfile(ckpt / old, outside)
    new = rnd.choice(
        [f"../{outside.name}", str(outside), f"./{old}", f"sub/{old}", f"{old}\x00", "..",
         ".", "", MANIFEST, f"C:\\{old}", "/etc/passwd", "/etc/hostname", f"{old}/"]
    )  # fmt: skip
    if where == "chunk":
        t["chunks"][0]["file"] = new
    elif where == "context":
        m["context"] = new
    if where != "chunk" or rnd.random() < 0.7:
        m["files"][new] = m["files"].pop(old)
        for tt in m["tensors"].values():
            for c in tt["chunks"]:
                c["file"] = new if c["file"] == old else c["file"]
        m["context"] = new if m["context"] == old else m["context"]
    return f"{where} file {old!r} -> {new!r}"


def e_files(m: dict[str, Any], rnd: Rnd) -> str:
    name = rnd.choice(sorted(m["files"]))
    rec = m["files"][name]
    crc = rec["checksum"]
    flipped = crc[:-1] + ("0" if crc[-1] != "0" else "1")
    options: list[tuple[str, Any]] = [
        ("bytes+1", {**rec, "bytes": rec["bytes"] + 1}),
        ("bytes-1", {**rec, "bytes": rec["bytes"] - 1}),
        ("bytes negative", {**rec, "bytes": -1}),
        ("bytes string", {**rec, "bytes": str(rec["bytes"])}),
        ("bytes float", {**rec, "bytes": float(rec["bytes"])}),
        ("checksum digit", {**rec, "checksum": flipped}),
        ("checksum upper", {**rec, "checksum": crc.upper()}),
        ("checksum sha1", {**rec, "checksum": "sha1:" + crc[6:]}),
        ("checksum short", {**rec, "checksum": crc[:-1]}),
        ("checksum hex junk", {**rec, "checksum": "crc32:xyzxyzxy"}),
        ("no checksum", {"bytes": rec["bytes"]}),
        ("record null", None),
        ("record list", [rec["bytes"], crc]),
    ]
    what, new = rnd.choice(options)
    if rnd.random() < 0.15:
        del m["files"][name]
        return f"files[{name!r}] removed"
    if rnd.random() < 0.15:
        m["files"][rnd.choice(["missing.bin", MANIFEST, "manifest.json.tmp"])] = dict(rec)
        return "files: an extra entry"
    m["files"][name] = new
    return f"files[{name!r}]: {what}"


def e_step(m: dict[str, Any], rnd: Rnd) -> str:
    new = rnd.choice(
        [m["step"] + 1, m["step"] - 1, -1, str(m["step"]), True, float(m["step"]), None, 2**53]
    )
    m["step"] = new
    return f"step -> {new!r}"


def e_context_name(m: dict[str, Any], rnd: Rnd) -> str:
    new = rnd.choice([*sorted(m["files"]), "missing.json", None, 3])
    m["context"] = new
    return f"context -> {new!r}"


def e_version(m: dict[str, Any], rnd: Rnd) -> str:
    options: list[tuple[str, Any]] = [
        ("minor 0", {"major": 1, "minor": 0}),
        ("minor 2", {"major": 1, "minor": 2}),
        ("minor -1", {"major": 1, "minor": -1}),
        ("minor string", {"major": 1, "minor": "1"}),
        ("major 2", {"major": 2, "minor": 1}),
        ("major 0", {"major": 0, "minor": 1}),
        ("major true", {"major": True, "minor": 1}),
        ("major float", {"major": 1.0, "minor": 1}),
        ("version string", "1.1"),
        ("version missing", None),
    ]
    what, new = rnd.choice(options)
    if new is None:
        del m["version"]
    else:
        m["version"] = new
    if rnd.random() < 0.2:
        m["format"] = rnd.choice(["perdure-checkpoint2", "", None])
        what += ", format changed"
    return f"version: {what}"


def e_rename_tensor(m: dict[str, Any], rnd: Rnd) -> str:
    name, t = _tensor(m, rnd)
    new = rnd.choice(
        [name + "x", name.replace("model/", "optimizer/", 1), name[:-1], "", "model/",
         name.replace("optimizer/", "model/", 1), "weights/" + name, name.upper()]
    )  # fmt: skip
    m["tensors"] = {(new if k == name else k): v for k, v in m["tensors"].items()}
    if len(t["chunks"]) == 1 and rnd.random() < 0.5:
        t["chunks"][0]["key"] = new
        return f"tensor {name} renamed {new!r} with its chunk key"
    return f"tensor {name} renamed {new!r}"


def e_tensor_set(m: dict[str, Any], rnd: Rnd) -> str:
    name, t = _tensor(m, rnd)
    if rnd.random() < 0.5:
        del m["tensors"][name]
        return f"tensor {name} removed"
    m["tensors"][name + "_copy"] = json.loads(json.dumps(t))
    return f"tensor {name} duplicated under another name"


def e_random_node(m: dict[str, Any], rnd: Rnd) -> str:
    """Replace one random node of the manifest with a value of another type."""
    path: list[Any] = []
    node: Any = m
    while isinstance(node, (dict, list)) and node and (not path or rnd.random() < 0.75):
        key = rnd.choice(sorted(node) if isinstance(node, dict) else range(len(node)))
        path.append(key)
        node = node[key]
    if not path:
        return "no node"
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    new = rnd.choice([None, [], {}, "x", 1.5, True, 0, -1, 2**60, [[]], {"$tensor": "x"}])
    parent[path[-1]] = new
    return f"node {path} -> {new!r}"


def e_harmless(m: dict[str, Any], rnd: Rnd) -> str:
    """Edits that must not change what is loaded: optional fields, unknown fields, order."""
    what = rnd.choice(["created", "summary", "writers", "unknown", "unknown-in-entry", "reorder"])
    if what == "created":
        m["created_unix"] = rnd.choice([0.0, 1e9, "yesterday"])
    elif what == "summary":
        m["summary"] = rnd.choice([{}, None, {"config_hash": "sha256:00"}])
    elif what == "writers":
        m["writers"] = rnd.choice([1, 2, 7, "many"])
    elif what == "unknown":
        m["future_field"] = {"anything": [1, 2]}
    elif what == "unknown-in-entry":
        _, t = _tensor(m, rnd)
        t["future"] = 1
        t["chunks"][0]["future"] = "x"
    else:
        items = list(m["tensors"].items())
        rnd.shuffle(items)
        m["tensors"] = dict(items)
        files = list(m["files"].items())
        rnd.shuffle(files)
        m["files"] = dict(files)
    return f"harmless: {what}"


EDITS: list[Callable[[dict[str, Any], Rnd], str]] = [
    e_rows, e_swap_keys, e_swap_files, e_dtype, e_shape, e_chunks, e_files, e_step,
    e_context_name, e_version, e_rename_tensor, e_tensor_set, e_random_node, e_harmless,
]  # fmt: skip


def _edit(ckpt: Path, m: dict[str, Any], rnd: Rnd) -> str:
    if rnd.random() < 0.12:
        return e_filename(m, rnd, ckpt)
    return rnd.choice(EDITS)(m, rnd)


def m_edit_resealed(ckpt: Path, rnd: Rnd) -> str:
    m = read_json(ckpt / MANIFEST)
    what = _edit(ckpt, m, rnd)
    write_manifest(ckpt, m, seal=True)
    return what + ", resealed"


def m_edit_unsealed(ckpt: Path, rnd: Rnd) -> str:
    m = read_json(ckpt / MANIFEST)
    what = _edit(ckpt, m, rnd)
    write_manifest(ckpt, m, seal=False, rnd=rnd)
    return what + ", written without a seal"


def m_edit_legacy(ckpt: Path, rnd: Rnd) -> str:
    """A format 1.0 manifest (no seal) with or without one edit: structure alone decides."""
    m = read_json(ckpt / MANIFEST)
    m["version"] = {"major": 1, "minor": 0}
    what = _edit(ckpt, m, rnd) if rnd.random() < 0.8 else "no edit"
    write_manifest(ckpt, m, seal=False, rnd=rnd)
    return f"format 1.0 manifest, {what}"


def m_whitespace(ckpt: Path, rnd: Rnd) -> str:
    m = read_json(ckpt / MANIFEST)
    seal = rnd.random() < 0.5
    if seal:
        write_manifest(ckpt, m, seal=True)
        prefix = manifest_prefix(ckpt).replace(b"\n ", b"\n    ")
        write_sealed_prefix(ckpt, prefix)
    else:
        data = (ckpt / MANIFEST).read_bytes()
        (ckpt / MANIFEST).write_bytes(data.replace(b": ", b":  ", 1))
    return "whitespace " + ("resealed" if seal else "edit under the seal")


# --- context and header edits, listing fixed ---------------------------------------------


def _context_edit(ctx: dict[str, Any], rnd: Rnd) -> str:
    what = rnd.choice(
        ["step", "drop", "type", "tag", "ref-unknown", "ref-twice", "ref-type", "unknown", "order"]
    )
    refs = _refs(ctx["optimizer"])
    if what == "step":
        ctx["step"] = rnd.choice([ctx["step"] + 1, str(ctx["step"]), True, None])
    elif what == "drop":
        del ctx[rnd.choice(sorted(CONTEXT_FIELDS))]
    elif what == "type":  # a value of another type (one of the same type is valid data)
        key = rnd.choice(sorted(CONTEXT_FIELDS))
        values = [v for v in ([], "x", 1, None, {}, 1.5) if type(v) is not CONTEXT_FIELDS[key]]
        ctx[key] = rnd.choice(values)
    elif what == "tag":
        key = rnd.choice([k for k in CONTEXT_FIELDS if k not in ("step", "config_hash")])
        ctx[key] = rnd.choice(
            [{"$tuple": []}, {"$float": "abc"}, {"$dict": 5}, {"$dict": [[{}, 1]]}, {"$tuple": 3}]
        )
    elif what in ("ref-unknown", "ref-twice", "ref-type"):
        holder, _ = rnd.choice(refs)
        others = [n for _, n in refs if n != holder["$tensor"]]
        holder["$tensor"] = {"ref-unknown": "optimizer/nope", "ref-type": 3}.get(
            what, rnd.choice(others) if others else "x"
        )
    elif what == "unknown":
        ctx["future_field"] = [1, 2, 3]
    else:
        items = list(ctx.items())
        rnd.shuffle(items)
        ctx.clear()
        ctx.update(items)
    return what


def _refs(value: Any) -> list[tuple[dict[str, Any], str]]:
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict) and len(v) == 1 and "$tensor" in v:
            out.append((v, v["$tensor"]))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def m_context(ckpt: Path, rnd: Rnd) -> str:
    """One structural edit of the context file; its size and CRC listed anew, the manifest
    resealed. (No bit flips here: with the CRC fixed they would be a new, valid value.)"""
    name = read_json(ckpt / MANIFEST)["context"]
    file = ckpt / name
    data = file.read_bytes()
    if rnd.random() < 0.35:
        i = rnd.randrange(1, len(data) - 1)
        what, new = rnd.choice(
            [
                ("non-UTF-8 byte", data[:i] + b"\xff" + data[i:]),
                ("UTF-8 BOM", b"\xef\xbb\xbf" + data),
                ("UTF-16", data.decode().encode("utf-16")),
                ("truncated", data[:i]),
                ("NaN literal", b'{"nan":NaN,' + data[1:]),
                ("duplicate step", b'{"step":8,' + data[1:]),
                ("deep nesting", b'{"deep":' + b"[" * 100_000 + b"]" * 100_000 + b"," + data[1:]),
                ("re-indented", json.dumps(json.loads(data), indent=2).encode()),
            ]
        )
    else:
        ctx = json.loads(data)
        what = _context_edit(ctx, rnd)
        new = json.dumps(ctx, separators=(",", ":")).encode()
    file.write_bytes(new)
    fix_listing(ckpt, name)
    return f"context: {what}, listing fixed"


def m_header(ckpt: Path, rnd: Rnd) -> str:
    """One edit of a safetensors header; the file's size and CRC listed anew."""
    file = rnd.choice(tensor_files(ckpt))
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, rest = json.loads(data[8 : 8 + n]), data[8 + n :]
    what = _header_edit(header, rnd)
    raw = json.dumps(header, separators=(",", ":")).encode()
    if what.startswith("raw"):
        i = rnd.randrange(1, len(raw) - 1)
        raw = raw[:i] + rnd.choice([b"\xff", b"\x00", b"NaN"]) + raw[i:]
    raw += b" " * (-(8 + len(raw)) % 8)
    length = len(raw) if rnd.random() < 0.9 else len(raw) + rnd.choice([-8, 8, 10**6])
    file.write_bytes(struct.pack("<Q", length) + raw + rest)
    fix_listing(ckpt, file.name)
    return f"header of {file.name}: {what} (length {length} of {len(raw)}), listing fixed"


def _header_edit(header: dict[str, Any], rnd: Rnd) -> str:
    keys = [k for k in header if k != "__metadata__"]
    key = rnd.choice(keys)
    e = header[key]
    what = rnd.choice(["dtype", "shape", "offsets", "rename", "drop", "add", "meta", "raw", "same"])
    if what == "dtype":
        e["dtype"] = rnd.choice([d for d in DTYPE_SIZES if d != e["dtype"]])
    elif what == "shape":
        e["shape"] = [*e["shape"], 1] if rnd.random() < 0.5 else list(reversed(e["shape"]))
    elif what == "offsets":
        a, b = e["data_offsets"]
        e["data_offsets"] = rnd.choice([[a, b + 4], [a + 4, b + 4], [b, a], [a, 10**12]])
    elif what == "rename":
        header[key + "x"] = header.pop(key)
    elif what == "drop":
        del header[key]
    elif what == "add":
        header["bogus"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    elif what == "meta":
        header["__metadata__"] = rnd.choice([{"format": 1}, [], "x", {"writer": "someone else"}])
    return f"{what} ({key})"


MUTATIONS: dict[str, Callable[[Path, Rnd], str]] = {
    "flip": m_flip,
    "truncate": m_truncate,
    "extend": m_extend,
    "digit": m_digit,
    "digit_resealed": m_digit_resealed,
    "raw_manifest_resealed": m_raw_manifest_resealed,
    "edit_resealed": m_edit_resealed,
    "edit_unsealed": m_edit_unsealed,
    "edit_legacy": m_edit_legacy,
    "whitespace": m_whitespace,
    "context": m_context,
    "header": m_header,
}


def mutate_and_judge(
    base: Path, want: dict[str, str], work: Path, kind: str, rnd: Rnd, tally: Tally
) -> list[str]:
    """Copy ``base`` into ``work``, apply mutation ``kind``, run every check, record."""
    ckpt = work / base.name
    shutil.copytree(base, ckpt)
    what = MUTATIONS[kind](ckpt, rnd)
    return tally.add(kind, f"{base.parent.name}/{base.name}: {what}", run_checks(ckpt), want)
