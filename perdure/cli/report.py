"""``perdure report RUN_DIR``: write a self-contained HTML report of a run and print its path."""

from __future__ import annotations

import click


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the report (default: RUN_DIR/report.html).",
)
def report(run_dir: str, out: str | None) -> None:
    """Write RUN_DIR/report.html: loss with faults marked, step time with membership
    changes, slot assignment per worker, the fault table, the decision log and events.
    The file needs no network and no scripts."""
    from perdure.report import write_report

    click.echo(str(write_report(run_dir, out)))
