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
def check(file: str, canonical: bool) -> None:
    """Validate FILE; print its config hash, or every problem found, and exit 1."""
    from perdure.run_config import canonical as canon
    from perdure.run_config import config_hash, load_config

    try:
        cfg = load_config(file)
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(1)
    click.echo(f"{file}: ok")
    click.echo(f"config hash: {config_hash(cfg)}")
    if canonical:
        click.echo(json.dumps(canon(cfg), indent=2, sort_keys=True))


@config.command("fields")
def fields() -> None:
    """Print the reference of every config field (the source of docs/configuration.md)."""
    from perdure.run_config.reference import reference_markdown

    click.echo(reference_markdown(), nl=False)
