"""``perdure data``: build, import, verify and inspect versioned datasets."""

from __future__ import annotations

import functools
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import click

from perdure.config import RenamedWarning


def _part_mb_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--part-mb``, and its old name ``--shard-mb`` (hidden; a RenamedWarning)."""

    @functools.wraps(f)
    def command(*args: Any, shard_mb: float | None = None, **kw: Any) -> Any:
        if shard_mb is not None:
            warnings.warn("--shard-mb is now called --part-mb; the old name will be refused "
                          "in a later release", RenamedWarning, stacklevel=2)  # fmt: skip
            kw["part_mb"] = shard_mb
        return f(*args, **kw)

    command = click.option("--shard-mb", type=float, default=None, hidden=True,
                           help="Old name of --part-mb.")(command)  # fmt: skip
    return click.option("--part-mb", default=64.0, show_default=True,
                        help="Target part size in MiB.")(command)  # fmt: skip


@click.group()
def data() -> None:
    """Build, import, verify and inspect versioned datasets (manifest + checksummed parts)."""


@data.command("build")
@click.argument("sources", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option(
    "--seq-len",
    default=128,
    show_default=True,
    help="Tokens a model reads per sample; samples hold seq_len + 1 tokens.",
)
@_part_mb_option
@click.option("--include", default="*", show_default=True, help="File-name pattern in dirs.")
@click.option("--max-mb", type=float, default=None, help="Read at most this many MiB of source.")
@click.option(
    "--tokenizer",
    "tokenizer",
    metavar="MODULE:FUNCTION",
    default=None,
    help="A callable text -> list of token ids (default: bytes, vocabulary 256). "
    "Its module is imported from the working directory or sys.path.",
)
@click.option(
    "--tokenizer-file",
    type=click.Path(exists=True),
    default=None,
    help="A local file or directory (e.g. tokenizer.json) handed to --tokenizer, "
    "which is then a factory called once as MODULE:FUNCTION(PATH); its "
    "SHA-256 enters the version id. perdure.data.hf:tokenizer_json loads a "
    "Hugging Face tokenizers file.",
)
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Token ids are below this (at least what --tokenizer reports). Default: "
    "what the tokenizer reports, else the largest id seen + 1.",
)
@click.option(
    "--separator",
    type=int,
    default=None,
    help="Token id appended after every source file. Default: the tokenizer's "
    "eos_id if it reports one, else 0 (the NUL byte for bytes).",
)
@click.option(
    "--text-field",
    default=None,
    metavar="NAME",
    help="SOURCES are records (.jsonl, .jsonl.gz, .jsonl.zst, .parquet, a datasets "
    "save_to_disk directory; directories searched for them) and this string field "
    "of each is one document. Default: each file is one document.",
)
@click.option(
    "--skip-bad-records",
    is_flag=True,
    help="With --text-field: skip a record whose field is missing or not a string "
    "(counted in the manifest) instead of failing naming it.",
)
@click.option(
    "--processes",
    type=int,
    default=None,
    help="Worker processes that tokenize (default: the cores). The parts are "
    "byte-identical for every count.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue an interrupted build of the same SOURCES and flags from its last "
    "finished chunk (same bytes as an uninterrupted build).",
)
@click.option("--quiet", is_flag=True, help="No progress line.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def build(
    sources: tuple[str, ...],
    out: str,
    seq_len: int,
    part_mb: float,
    include: str,
    max_mb: float | None,
    tokenizer: str | None,
    tokenizer_file: str | None,
    vocab_size: int | None,
    separator: int | None,
    text_field: str | None,
    skip_bad_records: bool,
    processes: int | None,
    resume: bool,
    quiet: bool,
    force: bool,
) -> None:
    """Tokenize SOURCES (files, directories, globs; or records with --text-field) into a
    dataset at OUT (byte-level unless --tokenizer)."""
    from perdure.data import DataError, build_dataset

    if tokenizer is None and tokenizer_file is not None:
        _fail("--tokenizer-file: needs --tokenizer (the factory to hand the file to)")
    if tokenizer is None and vocab_size is not None:
        _fail("--vocab-size: the byte tokenizer's vocabulary is 256; pass --tokenizer too")
    if skip_bad_records and text_field is None:
        _fail("--skip-bad-records: needs --text-field (only records can be bad)")
    from perdure.cli.progress import ProgressLine

    procs = processes if processes is not None else default_processes()
    start = time.perf_counter()
    line = ProgressLine(enabled=not quiet)
    try:
        m = build_dataset(list(sources), out, seq_len=seq_len, part_mb=part_mb,
                          include=include, max_mb=max_mb, overwrite=force,
                          tokenizer=tokenizer, tokenizer_file=tokenizer_file,
                          vocab_size=vocab_size, separator=separator, text_field=text_field,
                          skip_bad_records=skip_bad_records, processes=procs, resume=resume,
                          progress=line.update, say=line.say)  # fmt: skip
    except DataError as e:
        line.close()
        _fail(str(e))
    except KeyboardInterrupt:
        line.close()
        _fail("interrupted: pass --resume to continue this build from its last chunk")
    line.close()
    took = time.perf_counter() - start
    docs = f"{m.sources['documents']} records of " if "documents" in m.sources else ""
    click.echo(f"{out}: {m.num_samples} samples of {seq_len + 1} tokens in {len(m.parts)} "
               f"parts from {docs}{m.sources['files']} files ({m.sources['bytes']} bytes) in "
               f"{took:.2f} s on {procs} process{'es' if procs != 1 else ''}")  # fmt: skip
    skipped = m.sources.get("skipped_records")
    if skipped:
        click.echo(f"skipped {skipped['count']} bad records (listed in the manifest)")
    _say_vocab(m)
    click.echo(f"version id: {m.version_id}")


@data.command("import")
@click.argument("files", nargs=-1)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option(
    "--seq-len",
    type=int,
    default=None,
    help="Cut 1-D streams into samples of seq_len + 1 values (the tail that does "
    "not fill a sample is dropped). Needed for a 1-D source.",
)
@click.option(
    "--dtype",
    default=None,
    metavar="DTYPE",
    help="Dtype of raw (non-.npy) files: uint16 for nanoGPT's train.bin; uint8, "
    "int8, uint16, int16, uint32, int32, int64, float16, float32, float64.",
)
@click.option(
    "--field",
    "extra",
    multiple=True,
    metavar="NAME=PATH[:DTYPE]",
    help="Another per-sample field (e.g. labels, loss_mask) from a file; repeat "
    "to add fields or to append files to one. :DTYPE for a raw file "
    "(default --dtype). tokens=PATH adds token files too.",
)
@click.option(
    "--vocab-size",
    type=int,
    default=None,
    help="Token ids are below this. Default: the largest id + 1.",
)
@click.option(
    "--tokenizer-name",
    default="pretokenized",
    show_default=True,
    help="What produced the tokens (e.g. gpt2): enters the version id.",
)
@_part_mb_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["arrays", "megatron", "mds"]),
    default="arrays",
    show_default=True,
    help="arrays: FILES are .npy or raw token files; megatron: FILES are Megatron-LM "
    "indexed dataset PREFIXes (PREFIX.idx + PREFIX.bin, any dtype); mds: FILES are "
    "MosaicML Streaming (MDS) directories whose --mds-column holds the tokens.",
)
@click.option(
    "--mds-column",
    default="tokens",
    show_default=True,
    help="With --format mds: the column holding the token ids.",
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Reference the token files where they lie (a local path or fsspec URL) instead "
    "of copying them: the manifest records each file's size and SHA-256, and a file "
    "changed since is refused by name. Tokens only (no --field); --format arrays or "
    "megatron; each file is cut into samples on its own.",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def import_(
    files: tuple[str, ...],
    out: str,
    seq_len: int | None,
    dtype: str | None,
    extra: tuple[str, ...],
    vocab_size: int | None,
    tokenizer_name: str,
    part_mb: float,
    fmt: str,
    mds_column: str,
    in_place: bool,
    force: bool,
) -> None:
    """Import pre-tokenized FILES (.npy, or raw little-endian token files) as the tokens of
    a dataset at OUT, with any other --field; .npy and .npz files carry their dtype and
    shape. Without FILES the dataset has no tokens: only its --field arrays (images and
    labels: --field images=x.npy --field labels=y.npy)."""
    from perdure.data import DataError
    from perdure.data.importer import import_arrays

    if in_place:
        _import_in_place(fmt, list(files), out, seq_len, dtype, vocab_size, tokenizer_name,
                         bool(extra), force)  # fmt: skip
        return
    if fmt != "arrays":
        if extra:
            _fail(f"--field: not with --format {fmt} (the format holds the tokens only)")
        _import_format(fmt, list(files), out, seq_len, dtype, vocab_size, tokenizer_name,
                       part_mb, mds_column, force)  # fmt: skip
        return
    fields: dict[str, list[str]] = {"tokens": list(files)} if files else {}
    dtypes: dict[str, str] = {}
    for spec in extra:
        name, path, raw = _field_spec(spec)
        fields.setdefault(name, []).append(path)
        if raw is not None:
            if dtypes.get(name, raw) != raw:
                _fail(f"--field: {name} given with dtypes {dtypes[name]} and {raw}")
            dtypes[name] = raw
    start = time.perf_counter()
    try:
        m = import_arrays(fields, out, seq_len=seq_len, dtype=dtype, dtypes=dtypes,
                          vocab_size=vocab_size, tokenizer=tokenizer_name, part_mb=part_mb,
                          overwrite=force)  # fmt: skip
    except DataError as e:
        _fail(str(e))
    took = time.perf_counter() - start
    layout = ", ".join(f.describe() for f in m.fields)
    click.echo(f"{out}: {m.num_samples} samples ({layout}) in {len(m.parts)} parts from "
               f"{m.sources['files']} files in {took:.2f} s")  # fmt: skip
    for name, n in m.sources.get("dropped_tail", {}).items():
        if n:
            click.echo(f"dropped the last {n} values of {name}: fewer than one sample")
    _say_vocab(m)
    click.echo(f"version id: {m.version_id}")


def default_processes() -> int:
    """The cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _import_in_place(fmt: str, paths: list[str], out: str, seq_len: int | None,
                     dtype: str | None, vocab: int | None, tokenizer: str, extra: bool,
                     force: bool) -> None:  # fmt: skip
    from perdure.data import DataError
    from perdure.data.formats import read_megatron
    from perdure.data.inplace import import_in_place

    if extra:
        _fail("--in-place: tokens only (no --field)")
    if fmt == "mds":
        _fail("--in-place: MDS parts interleave sample headers with the tokens; import "
              "them without --in-place (a copy)")  # fmt: skip
    if seq_len is None:
        _fail("--in-place: needs --seq-len")
    start = time.perf_counter()
    try:
        note: dict[str, Any] = {}
        if fmt == "megatron":
            idx = [read_megatron(p) for p in paths]
            paths, dtype = [str(i.bin_path) for i in idx], idx[0].dtype
            note = {"format": "megatron", "documents": sum(i.doc_starts.size for i in idx)}
        m = import_in_place(paths, out, seq_len=seq_len, dtype=dtype, vocab_size=vocab,
                            tokenizer=tokenizer, overwrite=force, note=note)  # fmt: skip
    except DataError as e:
        _fail(str(e))
    took = time.perf_counter() - start
    size = m.sources["bytes"]
    click.echo(f"{out}: {m.num_samples} samples of {m.seq_len + 1} tokens referencing "
               f"{len(m.parts)} files in place ({size} bytes) in {took:.2f} s")  # fmt: skip
    _say_vocab(m)
    click.echo(f"version id: {m.version_id}")


def _import_format(fmt: str, paths: list[str], out: str, seq_len: int | None,
                   dtype: str | None, vocab: int | None, tokenizer: str, part_mb: float,
                   column: str, force: bool) -> None:  # fmt: skip
    from perdure.data import DataError
    from perdure.data.formats import import_mds, import_megatron

    kw: dict[str, Any] = {"seq_len": seq_len, "vocab_size": vocab, "tokenizer": tokenizer,
                          "part_mb": part_mb, "overwrite": force}  # fmt: skip
    start = time.perf_counter()
    try:
        if fmt == "megatron":
            if dtype is not None:
                _fail("--dtype: not with --format megatron (the .idx names the dtype)")
            m = import_megatron(paths, out, **kw)
        else:
            m = import_mds(paths, out, column=column, dtype=dtype, **kw)
    except DataError as e:
        _fail(str(e))
    took = time.perf_counter() - start
    click.echo(f"{out}: {m.num_samples} samples of {m.seq_len + 1} tokens in {len(m.parts)} "
               f"parts from {len(paths)} {fmt} sources ({m.sources['documents']} documents) "
               f"in {took:.2f} s")  # fmt: skip
    for n in m.sources.get("dropped_tail", {}).values():
        if n:
            click.echo(f"dropped the last {n} tokens: fewer than one sample")
    _say_vocab(m)
    click.echo(f"version id: {m.version_id}")


def _field_spec(spec: str) -> tuple[str, str, str | None]:
    name, eq, rest = spec.partition("=")
    if not eq or not name or not rest:
        _fail(f"--field: must be NAME=PATH[:DTYPE] (got {spec!r})")
    path, colon, raw = rest.rpartition(":")
    if not colon or "/" in raw or "." in raw:  # no dtype suffix (or a ':' inside the path)
        return name, rest, None
    return name, path, raw


def _say_vocab(m: Any) -> None:
    source = m.sources.get("vocab_size_from")
    vocab = m.build.get("vocab_size")
    if source == "max_id":
        click.echo(f"vocabulary: {vocab} (the largest token id + 1; pass --vocab-size for "
                   "the tokenizer's own)")  # fmt: skip
    elif source is not None:
        click.echo(f"vocabulary: {vocab} (from {source})")


@data.command("verify")
@click.argument("url")
def verify(url: str) -> None:
    """Check every part of the dataset at URL against its manifest; exit 1 naming bad ones."""
    from perdure.data import DataError, Dataset
    from perdure.data.verify import verify_dataset

    try:
        ds = Dataset.open(url, check_files=False)
    except DataError as e:
        _fail(str(e))
    bad = verify_dataset(ds)
    for err in bad:
        click.echo(f"bad {err}", err=True)
    if bad:
        _fail(f"{url}: {len(bad)} of {ds.num_parts} parts failed verification")
    click.echo(f"{url}: ok, {ds.num_parts} parts, {ds.num_samples} samples, {ds.version_id}")


@data.command("inspect")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def inspect(url: str, as_json: bool) -> None:
    """Show the version id, samples, parts and tokens of the dataset at URL."""
    from perdure.data import DataError, Dataset

    try:
        ds = Dataset.open(url, check_files=False)
    except DataError as e:
        _fail(str(e))
    m = ds.manifest
    rows = {
        "version id": m.version_id,
        "samples": m.num_samples,
        "sample": f"{m.seq_len + 1} x {m.dtype} (seq_len {m.seq_len})"
        if m.tokens
        else f"{m.row_bytes} bytes (no tokens field)",
        "fields": "; ".join(f.describe() for f in m.fields),
        "tokens": m.num_tokens,
        "parts": len(m.parts),
        "bytes": sum(s.bytes for s in m.parts),
        "build": json.dumps(m.build, sort_keys=True),
        "sources": json.dumps(m.sources, sort_keys=True),
    }
    if as_json:
        click.echo(json.dumps({k.replace(" ", "_"): v for k, v in rows.items()}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=url, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for k, v in rows.items():
        table.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    Console().print(table)


def _fail(message: str) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(1)
