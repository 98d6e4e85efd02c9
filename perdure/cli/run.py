"""``perdure run CONFIG``: train on this machine with the local launcher."""

from __future__ import annotations

import json
import sys
import tomllib

import click

from perdure.config.errors import ConfigError


@click.command()
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option(
    "--steps", type=int, default=None, help="Override train.steps (changes the config hash)."
)
@click.option(
    "--workers",
    type=int,
    default=None,
    help="Override the worker count, spread round robin over the configured regions.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: runs/<time>-<config hash>).",
)
@click.option(
    "--resume",
    default=None,
    help="Continue from 'latest' (in --run-dir), a run directory or a checkpoint.",
)
@click.option(
    "--chaos",
    "chaos_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="TOML fault schedule ([[faults]] tables) replacing the config's [chaos].",
)
@click.option(
    "--timeout-s",
    type=float,
    default=3600.0,
    show_default=True,
    help="Give up (and stop every process) after this many seconds.",
)
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="With --resume: continue from a checkpoint written under another config hash "
    "(the override is recorded in the decision log).",
)
@click.option(
    "--launcher",
    type=click.Choice(["local", "ray"]),
    default=None,
    help="What starts the run's processes: 'local' (this machine) or 'ray' (Ray actors on "
    "a cluster, placed by region); default: the config's run.launcher.",
)
@click.option(
    "--ray-address",
    default=None,
    help="With --launcher ray: the cluster's HOST:PORT, 'auto' or 'local' (overrides ray.address).",
)
@click.option("--live/--no-live", default=None, help="Live terminal view (default: when a TTY).")
def run(
    config_file: str,
    steps: int | None,
    workers: int | None,
    run_dir: str | None,
    resume: str | None,
    chaos_file: str | None,
    timeout_s: float,
    allow_config_change: bool,
    launcher: str | None,
    ray_address: str | None,
    live: bool | None,
) -> None:
    """Train CONFIG: a coordinator and one process per worker, on this machine or (with
    --launcher ray) as Ray actors on a cluster."""
    from perdure.launch.api import run as run_api
    from perdure.launch.api import spread_workers
    from perdure.launch.local import RunFailed
    from perdure.launch.lock import RunDirLocked
    from perdure.run_config import load_config, with_overrides

    try:
        cfg = load_config(config_file)
        if steps is not None:
            cfg = with_overrides(cfg, train={"steps": steps})
        if workers is not None:
            cfg = spread_workers(cfg, workers)
        if chaos_file:
            with open(chaos_file, "rb") as f:
                cfg = with_overrides(cfg, chaos=tomllib.load(f))
        if launcher is not None:
            cfg = with_overrides(cfg, run={"launcher": launcher})
        if ray_address is not None:
            if cfg.run.launcher != "ray":
                click.echo("--ray-address: needs --launcher ray (or run.launcher 'ray')", err=True)
                sys.exit(2)
            cfg = with_overrides(cfg, ray={"address": ray_address})
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    except (OSError, tomllib.TOMLDecodeError) as e:
        click.echo(f"--chaos {chaos_file}: {e}", err=True)
        sys.exit(2)
    show = sys.stdout.isatty() and cfg.run.live_view if live is None else live
    try:
        summary = run_api(
            cfg,
            run_dir=run_dir or cfg.run.dir,
            resume=resume,
            live=show,
            timeout_s=timeout_s,
            allow_config_change=allow_config_change,
            source=config_file,
        )
    except (FileExistsError, FileNotFoundError, ConfigError, RunDirLocked) as e:  # refused
        click.echo(str(e), err=True)
        sys.exit(2)
    except RunFailed as e:
        click.echo(f"run failed: {e}", err=True)
        sys.exit(1)
    except TimeoutError as e:  # the run did not end in time: the cause, in one line
        click.echo(str(e), err=True)
        sys.exit(1)
    click.echo(json.dumps(summary, indent=2))
