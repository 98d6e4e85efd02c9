"""``perdure sim CONFIG.toml``: simulate a deployment under each policy; print goodput."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.command()
@click.argument("config_file", metavar="CONFIG", type=click.Path(dir_okay=False, exists=True))
@click.option("--seeds", type=click.IntRange(min=1), default=None, help="Seeds (default: config).")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to write sim.json and the plots (default: runs/sim/<config name>).",
)
@click.option("--sweeps/--no-sweeps", default=True, help="Run the config's sweeps.")
@click.option(
    "--validate/--no-validate", default=True, help="Print predicted against measured runs."
)
@click.option(
    "--demo-config",
    type=click.Path(dir_okay=False),
    default="configs/demo.toml",
    show_default=True,
    help="The demo's config, whose schedule the validation simulates.",
)
def sim(
    config_file: str,
    seeds: int | None,
    out: str | None,
    sweeps: bool,
    validate: bool,
    demo_config: str,
) -> None:
    """Simulate CONFIG's deployment and failures under perdure, torchrun, torchft and
    DiLoCo (when the config names it), calibrated on benchmarks/results/*.json; print each
    policy's goodput with an interval over seeds, tokens/s and bytes across regions
    against the synchronous step, the validation table and the sweeps; write sim.json
    and plots."""
    from perdure.config import ConfigError
    from perdure.sim import output, sharding
    from perdure.sim.calibrate import CalibrationError, load_calibration
    from perdure.sim.config import load_sim_config
    from perdure.sim.run import run_config, sync_label
    from perdure.sim.sweep import run_sweeps
    from perdure.sim.validate import validation

    t0 = time.perf_counter()
    try:
        cfg = load_sim_config(config_file)
        cal = load_calibration(cfg.results_dir)
        summaries = run_config(cfg, cal, seeds)
        rows = validation(cal, cfg.results_dir, demo_config) if validate else []
        swept = run_sweeps(cfg, cal) if sweeps else []
    except (ConfigError, CalibrationError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(output.goodput_table(summaries, cfg.workload.days, seeds or cfg.seeds))
    memory = sharding.memory_line(cfg.workload, cfg.deployment, cfg.policies.perdure.int_bytes)
    click.echo("\n" + output.step_table(summaries, memory))
    click.echo("\n" + output.throughput_table(summaries, sync_label(cfg)))
    click.echo("\n" + output.cost_table(summaries))
    if rows:
        click.echo("\n" + output.validation_table(rows))
    for s in swept:
        click.echo("\n" + output.sweep_table(s))
    out_dir = Path(out) if out else Path("runs/sim") / Path(config_file).stem
    written = [output.write_json(out_dir / "sim.json", output.record(summaries, swept, rows))]
    written += [output.plot_sweep(s, out_dir) for s in swept]
    click.echo(f"\nwrote {', '.join(str(p) for p in written)}")
    click.echo(f"({time.perf_counter() - t0:.1f} s)")
