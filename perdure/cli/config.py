"""``perdure config``: validate run configs and show their hash."""

from __future__ import annotations

import json
import sys

import click

from perdure.config.errors import ConfigError


@click.group()
def config() -> None:
    """Validate run configs (TOML) and show their hash."""


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--canonical", is_flag=True, help="Also print the canonical (math-affecting) config as JSON."
)
@click.option(
    "--no-preflight",
    is_flag=True,
    help="Only the file's own rules: do not build the task or open the dataset.",
)
def check(file: str, canonical: bool, no_preflight: bool) -> None:
    """Validate FILE, then preflight it as `perdure run` would (build the task, open the
    dataset, check one against the other); print its config hash, or every problem found
    and exit 2."""
    from perdure.launch.preflight import preflight
    from perdure.run_config import canonical as canon
    from perdure.run_config import config_hash, load_config

    try:
        cfg = load_config(file)
        report = None if no_preflight else preflight(cfg, source=file)
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    for note in report.notes if report else []:
        click.echo(f"note: {note}")
    took = f" (preflight {report.seconds:.2f} s)" if report else ""
    click.echo(f"{file}: ok{took}")
    identity = report.identity if report else None
    click.echo(f"config hash: {config_hash(cfg, identity)}")
    if identity is None:
        click.echo("note: the file's settings only (without the dataset version and recipe)")
    if canonical:
        click.echo(json.dumps(canon(cfg, identity), indent=2, sort_keys=True))


@config.command("fields")
def fields() -> None:
    """Print the reference of every config field (the source of docs/configuration.md)."""
    from perdure.run_config.reference import reference_markdown

    click.echo(reference_markdown(), nl=False)
