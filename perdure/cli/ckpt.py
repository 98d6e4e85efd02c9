"""``perdure ckpt``: list, inspect, verify, diff and hash checkpoints.

Every command that takes PATH also accepts a checkpoint root, meaning its newest
committed checkpoint (said on stderr). Exit status: 0 ok, 1 corrupt or different, 2 usage.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import click


def _resolve(path: str) -> Path:
    from perdure.checkpoint import list_checkpoints
    from perdure.checkpoint.layout import MANIFEST

    p = Path(path)
    if not p.exists():  # a mistyped path is not a corrupt checkpoint
        click.echo(f"{p}: no such checkpoint or run directory (it does not exist)", err=True)
        sys.exit(2)
    if (p / MANIFEST).exists() or not p.is_dir():
        return p
    if (p / "checkpoints").is_dir() and not list_checkpoints(p):
        p = p / "checkpoints"  # a run directory: its checkpoints' root
    found = list_checkpoints(p)
    if not found:
        return p
    click.echo(f"{p}: using the newest committed checkpoint, {found[-1].name}", err=True)
    return found[-1]


def _fail(e: Exception) -> NoReturn:
    click.echo(f"corrupt: {e}", err=True)
    sys.exit(1)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@click.group()
def ckpt() -> None:
    """Checkpoints: list, inspect, verify, diff and hash them; export and import."""


@ckpt.command("ls")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--verify", is_flag=True, help="Also check every checksum (reads every byte).")
def ls(root: str, verify: bool) -> None:
    """List the committed checkpoints under ROOT, oldest first, with their state."""
    from rich.console import Console
    from rich.table import Table

    from perdure.checkpoint import CheckpointError, list_checkpoints
    from perdure.checkpoint.loader import verify_checkpoint

    table = Table("step")
    table.add_column("directory", no_wrap=True, min_width=14)
    for name in ("tensors", "bytes", "writers", "config hash", "status"):
        table.add_column(name)
    for p in list_checkpoints(root):
        try:
            with _notes() as notes:
                m = verify_checkpoint(p, checksums=verify)
            status = ("verified" if verify else "complete") + (" (unsealed 1.0)" if notes else "")
        except CheckpointError as e:
            m, status = {}, f"[red]bad: {e}[/red]"
        s = m.get("summary", {})
        size = sum(f["bytes"] for f in m.get("files", {}).values())
        table.add_row(
            str(m.get("step", "?")),
            p.name,
            str(len(m.get("tensors", {}))),
            _size(size),
            str(m.get("writers", "?")),
            str(s.get("config_hash", "?"))[:19],
            status,
        )
    Console().print(table)


@contextmanager
def _notes() -> Iterator[list[str]]:
    """Collect the format's notes (a format 1.0 manifest without a seal) as lines, so the
    caller prints one clean line instead of a Python warning with its source location."""
    from perdure.checkpoint.errors import LegacyManifestWarning

    lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LegacyManifestWarning)
        yield lines
    for w in caught:
        if issubclass(w.category, LegacyManifestWarning):
            lines.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


@ckpt.command("inspect")
@click.argument("path", type=click.Path())
def inspect(path: str) -> None:
    """The seven fields of the checkpoint at PATH (reads the manifest and context only)."""
    from rich.console import Console
    from rich.table import Table

    from perdure.checkpoint import CheckpointError, read_manifest
    from perdure.checkpoint.loader import check_files_present, context_fields, read_context

    p = _resolve(path)
    try:
        with _notes() as notes:
            m = read_manifest(p)
        check_files_present(p, m)
        ctx = read_context(p, m, verify=True)
        fields = context_fields(ctx, dict.fromkeys(m["tensors"]), str(p / m["context"]))
    except CheckpointError as e:
        _fail(e)
    for line in notes:
        click.echo(f"note: {line}", err=True)

    table = Table(
        "field", "value", title=f"{p} (format {m['version']['major']}.{m['version']['minor']})"
    )
    table.add_row("step", str(m["step"]))
    for label, prefix in (("weights", "model/"), ("optimizer state", "optimizer/")):
        table.add_row(label, _tensor_summary(m["tensors"], prefix))
    opt_groups = fields["optimizer"].get("param_groups")
    opt_groups = opt_groups if isinstance(opt_groups, list) else []
    groups = [
        {k: v for k, v in g.items() if k != "params"} for g in opt_groups if isinstance(g, dict)
    ]
    table.add_row("optimizer groups", _short(groups, 200))
    rng = fields["rng"]
    gens = ", ".join(k for k in rng if k not in ("seed", "slots"))
    per_slot = rng.get("slots")
    seeded = f"; each slot seeds {', '.join(per_slot['seeded'])}" if per_slot else ""
    table.add_row("rng seeds", f"seed {rng.get('seed')}; generators: {gens}{seeded}")
    table.add_row("data offset", _short(fields["data"], 200))
    table.add_row("config hash", ctx["config_hash"])
    table.add_row("cluster topology", _short(fields["topology"], 200))
    prov = fields["provenance"]
    dirty = " (dirty)" if prov.get("dirty") else ""
    table.add_row(
        "commit sha", f"{prov.get('sha')}{dirty}; {_short(prov.get('versions', {}), 120)}"
    )
    if prov.get("determinism"):
        table.add_row("determinism", _short(prov["determinism"], 200))
    table.add_row("decision log", f"{len(ctx['decisions'])} entries")
    table.add_row("files", ", ".join(f"{n} ({_size(f['bytes'])})" for n, f in m["files"].items()))
    Console().print(table)


def _tensor_summary(tensors: dict[str, Any], prefix: str) -> str:
    from perdure.checkpoint.tensors import Meta

    metas = [
        Meta(k, t["dtype"], tuple(t["shape"])) for k, t in tensors.items() if k.startswith(prefix)
    ]
    dtypes: dict[str, int] = {}
    for m in metas:
        dtypes[m.dtype] = dtypes.get(m.dtype, 0) + 1
    total = sum(m.nbytes for m in metas)
    kinds = ", ".join(f"{d} x{n}" for d, n in sorted(dtypes.items()))
    return f"{len(metas)} tensors, {_size(total)} ({kinds or 'none'})"


@ckpt.command("verify")
@click.argument("path", type=click.Path())
def verify(path: str) -> None:
    """Check every rule of the format and every file of PATH (manifest seal and structure,
    presence, sizes, headers, context, checksums): a checkpoint that passes loads into
    exactly the state it describes. Exit 1 naming the bad file and the rule."""
    from perdure.checkpoint import CheckpointError, verify_checkpoint
    from perdure.checkpoint.manifest import SEAL_KEY

    p = _resolve(path)
    try:
        with _notes() as notes:
            m = verify_checkpoint(p)
    except CheckpointError as e:
        _fail(e)
    for line in notes:
        click.echo(f"note: {line}", err=True)
    size = sum(f["bytes"] for f in m["files"].values())
    seal = "manifest sealed" if SEAL_KEY in m else "manifest unsealed (format 1.0)"
    click.echo(f"{p}: ok ({len(m['files'])} files, {_size(size)}, every crc32 matches, {seal})")


@ckpt.command("hash")
@click.argument("path", type=click.Path())
def hash_(path: str) -> None:
    """One digest over weights and optimizer state (equal digests: bitwise-equal state)."""
    from perdure.checkpoint import CheckpointError, load_checkpoint, state_digest

    try:
        loaded = load_checkpoint(_resolve(path))
    except CheckpointError as e:
        _fail(e)
    click.echo(state_digest(loaded.model, loaded.optimizer))


@ckpt.command("diff")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
def diff(a: str, b: str) -> None:
    """Which fields and tensors differ between checkpoints A and B, and whether the weights
    are bitwise equal. Exit 0 when everything is equal, 1 otherwise."""
    from perdure.checkpoint import CheckpointError, load_checkpoint
    from perdure.checkpoint.compare import compare

    try:
        x, y = load_checkpoint(_resolve(a)), load_checkpoint(_resolve(b))
    except CheckpointError as e:
        _fail(e)
    lines, equal = compare(x, y)
    for line in lines:
        click.echo(line)
    sys.exit(0 if equal else 1)


@ckpt.command("export")
@click.argument("path", type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "torch", "dcp", "hf"]),
    default="safetensors",
    show_default=True,
    help="safetensors: model.safetensors (safetensors.torch.load_file); torch: model.pt "
    "(torch.load(weights_only=True)); dcp: a PyTorch Distributed Checkpoint, the model's "
    "state-dict keys at the top level and the AdamW state by parameter name under "
    "'optimizer' (torch.distributed.checkpoint.load into a plain or FSDP2 model, then "
    "set_state_dict); hf: the task's transformers model via save_pretrained "
    "(from_pretrained).",
)
@click.option("--out", required=True, type=click.Path(), help="A new directory to write.")
@click.option(
    "--weights-only",
    is_flag=True,
    help="dcp: leave the optimizer state out (then the task need not be importable here).",
)
def export(path: str, fmt: str, out: str, weights_only: bool) -> None:
    """Write the model weights of the checkpoint at PATH (or a run's newest) as plain
    files, bit for bit; a sharded checkpoint too. With --format dcp, the optimizer state
    too, keyed by parameter name (the task is built to learn the names)."""
    from perdure.checkpoint import CheckpointError, load_checkpoint
    from perdure.checkpoint.dcp import DcpError, optimizer_by_name
    from perdure.checkpoint.export import ExportError, export_weights

    try:
        loaded = load_checkpoint(_resolve(path))
    except CheckpointError as e:
        _fail(e)
    build = (lambda: _build_model(loaded.canonical_config)) if fmt == "hf" else None
    try:
        optim = None
        if fmt == "dcp" and not weights_only:
            names = _param_names(loaded.canonical_config)
            optim = optimizer_by_name(loaded.optimizer, names)
        files = export_weights(loaded.model, out, fmt, build_model=build, optimizer=optim)
    except (ExportError, DcpError, ValueError) as e:
        click.echo(f"export: {e}", err=True)
        sys.exit(2)
    extra = " and the optimizer state" if optim is not None else ""
    click.echo(f"{out}: {', '.join(f.name for f in files)} ({len(loaded.model)} tensors{extra})")


@ckpt.command("import")
@click.argument("dcp_dir", type=click.Path())
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True),
    help="The run's config (TOML): its task builds the model the weights go into.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="A checkpoint root: the step-0 checkpoint is written under it.",
)
@click.option(
    "--weights-only",
    is_flag=True,
    help="Leave the DCP checkpoint's optimizer state out (AdamW starts fresh).",
)
def import_(dcp_dir: str, config_path: str, out: str, weights_only: bool) -> None:  # fmt: skip
    """Start a run from the PyTorch DCP checkpoint DCP_DIR: write the run's step-0
    checkpoint under OUT with the DCP weights (its keys: the model's state-dict names, at
    the top level) and, where it maps onto the run's optimizer, the AdamW state under
    'optimizer' (get_state_dict's layout), bit for bit. Then run
    `perdure run CONFIG --resume OUT/step-000000000`. A missing key or a shape that
    differs is refused naming the key; the task's scheduler starts fresh."""
    from perdure.checkpoint.dcp import DcpError
    from perdure.run_config import load_config
    from perdure.runtime.replica.dcp_import import import_dcp

    try:
        made = import_dcp(load_config(config_path), dcp_dir, out, optimizer=not weights_only)
    except DcpError as e:
        click.echo(f"import: {e}", err=True)
        sys.exit(2)
    click.echo(f"{made}: step 0 of the run; start it with "
               f"`perdure run {config_path} --resume {made}`")  # fmt: skip


def _param_names(canonical: dict[str, Any]) -> list[str]:
    """The optimizer's parameter names in index order, from the checkpoint's own config
    (its task and optimizer, built here on the side)."""
    from perdure.checkpoint.dcp import param_names
    from perdure.run_config import config_from_dict
    from perdure.runtime.replica.task import build_optimizer, build_task, plain_module

    keep = ("task", "run", "optim")
    cfg = config_from_dict({k: v for k, v in canonical.items() if k in keep})
    task = build_task(cfg.task, 0, cfg.run.base_dir)
    return param_names(plain_module(task.model), build_optimizer(task, cfg.optim))


def _build_model(canonical: dict[str, Any]) -> Any:
    """The task's model, from the checkpoint's own config (its entry and options)."""
    from perdure.run_config import config_from_dict
    from perdure.runtime.replica.task import build_task, plain_module

    cfg = config_from_dict({k: v for k, v in canonical.items() if k in ("task", "run")})
    return plain_module(build_task(cfg.task, 0, cfg.run.base_dir).model)
