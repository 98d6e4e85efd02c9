"""``perdure demo``: the main job, with live faults and the proof at the end."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click


@click.command()
@click.option(
    "--quick",
    is_flag=True,
    help="The shortened schedule (configs/demo_quick.toml): 2 regions, 160 steps.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Run this config instead of configs/demo.toml.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Run directory (default: runs/demo-<time>).",
)
@click.option("--live/--no-live", default=None, help="Live terminal view (default: when a TTY).")
def demo(quick: bool, config_file: str | None, run_dir: str | None, live: bool | None) -> None:
    """Train tiny_lm across simulated regions while all four failure classes strike, then
    prove the final parameters are bitwise-equal to a fault-free run."""
    from rich.console import Console

    from perdure.launch.api import run
    from perdure.launch.demo import fault_table, reference
    from perdure.launch.demo_data import DATASET, ensure_dataset
    from perdure.report import write_report
    from perdure.run_config import dataset_path, load_config

    console = Console() if sys.stdout.isatty() else Console(width=120)
    root = Path(__file__).resolve().parents[2]
    default = root / "configs" / ("demo_quick.toml" if quick else "demo.toml")
    config = load_config(config_file or default)
    version = ensure_dataset(
        Path(dataset_path(config) if config.data.dataset else DATASET), console
    )
    ref, source = reference(config, version, console)
    rd = Path(run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    show = sys.stdout.isatty() if live is None else live
    console.print(
        f"training {config.cluster.workers} workers in "
        f"{len(config.cluster.regions)} regions; run directory {rd}"
    )
    summary = run(config, run_dir=rd, live=show, timeout_s=3600)
    equal = summary["final_hash"] is not None and summary["final_hash"] == ref["final_hash"]
    summary["reference"] = {
        "final_hash": ref["final_hash"],
        "bitwise_equal": equal,
        "source": source,
    }
    (rd / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(fault_table(summary))
    console.print(
        f"faults injected {summary['faults_injected']}, absorbed {summary['faults_absorbed']}; "
        f"failures observed {summary['failures_observed']}, absorbed "
        f"{summary['failures_absorbed']}; survivor restarts {summary['survivor_restarts']}; "
        f"committed steps lost {summary['steps_lost']}; goodput {summary['goodput']}"
    )
    verdict = "[bold green]YES[/]" if equal else "[bold red]NO[/]"
    console.print(
        f"final parameters bitwise-equal to the fault-free reference ({source}): "
        f"{verdict}  {summary['final_hash']}"
    )
    console.print(f"report: {write_report(rd)}")
    sys.exit(0 if equal and summary["faults_absorbed"] == summary["faults_injected"] else 1)
