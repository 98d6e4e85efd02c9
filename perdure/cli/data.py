"""``perdure data``: build, verify and inspect versioned datasets."""

from __future__ import annotations

import json
import sys
import time
from typing import NoReturn

import click


@click.group()
def data() -> None:
    """Build, verify and inspect versioned datasets (manifest + checksummed shards)."""


@data.command("build")
@click.argument("sources", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--seq-len", default=128, show_default=True, help="Tokens per sample, minus one.")
@click.option("--shard-mb", default=64.0, show_default=True, help="Target shard size in MiB.")
@click.option("--include", default="*", show_default=True, help="File-name pattern in dirs.")
@click.option("--max-mb", type=float, default=None, help="Read at most this many MiB of source.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def build(
    sources: tuple[str, ...],
    out: str,
    seq_len: int,
    shard_mb: float,
    include: str,
    max_mb: float | None,
    force: bool,
) -> None:
    """Tokenize SOURCES (files, directories, globs) byte-level into a dataset at OUT."""
    from perdure.data import DataError, build_dataset

    start = time.perf_counter()
    try:
        m = build_dataset(list(sources), out, seq_len=seq_len, shard_mb=shard_mb,
                          include=include, max_mb=max_mb, overwrite=force)  # fmt: skip
    except DataError as e:
        _fail(str(e))
    took = time.perf_counter() - start
    click.echo(f"{out}: {m.num_samples} samples of {seq_len + 1} tokens in {len(m.shards)} "
               f"shards from {m.sources['files']} files ({m.sources['bytes']} bytes) in "
               f"{took:.2f} s")  # fmt: skip
    click.echo(f"version id: {m.version_id}")


@data.command("verify")
@click.argument("url")
def verify(url: str) -> None:
    """Check every shard of the dataset at URL against its manifest; exit 1 naming bad ones."""
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
        _fail(f"{url}: {len(bad)} of {ds.num_shards} shards failed verification")
    click.echo(f"{url}: ok, {ds.num_shards} shards, {ds.num_samples} samples, {ds.version_id}")


@data.command("inspect")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest summary as JSON.")
def inspect(url: str, as_json: bool) -> None:
    """Show the version id, samples, shards and tokens of the dataset at URL."""
    from perdure.data import DataError, Dataset

    try:
        ds = Dataset.open(url, check_files=False)
    except DataError as e:
        _fail(str(e))
    m = ds.manifest
    rows = {
        "version id": m.version_id,
        "samples": m.num_samples,
        "sample": f"{m.seq_len + 1} x {m.dtype} (seq_len {m.seq_len})",
        "tokens": m.num_tokens,
        "shards": len(m.shards),
        "bytes": sum(s.bytes for s in m.shards),
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
