"""``perdure worker`` and ``perdure coordinator``: the entry points a cluster manager starts."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING

import click

from perdure.runtime.entry import TOKEN_ENV

if TYPE_CHECKING:
    from perdure.run_config import RunConfig


def _exit(code: int) -> None:
    """Leave without running C++ destructors: a collective abandoned on a comm thread may
    still hold its process group, and tearing gloo down under it aborts the process."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _token() -> str:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise click.UsageError(f"set the run token in the environment variable {TOKEN_ENV}")
    return token


@click.command()
@click.option(
    "--coordinator",
    "coordinators",
    multiple=True,
    required=True,
    help="HOST:PORT of the coordinator's control channel; repeat to name standbys, "
    "tried in order when the current one is lost.",
)
@click.option("--name", required=True, help="Worker name, unique in the run (e.g. eu_west-1).")
@click.option("--region", required=True, help="Region (failure domain) this worker runs in.")
@click.option(
    "--role",
    type=click.Choice(["worker", "spare"]),
    default="worker",
    show_default=True,
    help="'spare' registers as a warm standby that holds no slots until a member fails.",
)
@click.option(
    "--yield-cpu-until-ready",
    is_flag=True,
    help="Start at the lowest CPU priority and take normal priority once ready to train "
    "(for replacements started on a machine whose cores the survivors are using).",
)
@click.option(
    "--host",
    default=None,
    help="Address this worker's data plane (gloo, NCCL) listens on and its peers dial "
    "(default: its own address on the path to the coordinator).",
)
@click.option(
    "--interface",
    default=None,
    help="Network interface of the data plane, by name (e.g. eth1), instead of --host "
    "(gloo's device; NCCL_SOCKET_IFNAME for NCCL).",
)
@click.option(
    "--device-index",
    type=click.IntRange(min=0),
    default=None,
    help="The GPU of this host it takes with train.device = 'cuda' (modulo the host's "
    "GPU count; default: $LOCAL_RANK, else 0). Ignored on the CPU.",
)
@click.option(
    "--join-timeout-s",
    default=60.0,
    show_default=True,
    help="Seconds to keep trying to reach a coordinator before giving up.",
)
def worker(
    coordinators: tuple[str, ...],
    name: str,
    region: str,
    role: str,
    yield_cpu_until_ready: bool,
    host: str | None,
    interface: str | None,
    device_index: int | None,
    join_timeout_s: float,
) -> None:
    """Join a run as a worker. The run token comes from $PERDURE_RUN_TOKEN.

    It exits when the run ends (0), when its coordinators refuse it (1, with the reason)
    or when none is reachable for --join-timeout-s (1)."""
    from perdure.runtime.control.channel import AdmissionRefused
    from perdure.runtime.entry import WorkerSpec, run_worker

    _token()
    try:
        spec = WorkerSpec(
            name=name,
            region=region,
            coordinators=list(coordinators),
            role=role,
            yield_cpu=yield_cpu_until_ready,
            join_timeout_s=join_timeout_s,
            host=host,
            interface=interface,
            device_index=device_index,
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--coordinator") from None
    try:
        code = run_worker(spec)
    except (AdmissionRefused, ConnectionError, ValueError) as e:
        click.echo(f"perdure worker {name}: {e}", err=True)
        code = 1
    _exit(code)


@click.command()
@click.option(
    "--config",
    "config_toml",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The run config (TOML), as for `perdure run`.",
)
@click.option(
    "--config-json",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The run config as JSON (what the local launcher writes to RUN_DIR/config.json).",
)
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run directory shared with the workers (events, metrics, checkpoints).",
)
@click.option(
    "--ports-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the chosen store and channel ports here as JSON.",
)
@click.option("--resume", default=None, help="Checkpoint directory the workers start from.")
@click.option(
    "--allow-config-change",
    is_flag=True,
    help="Let the workers resume from a checkpoint written under another config hash "
    "(each records the override in the decision log).",
)
@click.option(
    "--standby",
    is_flag=True,
    help="Start as a standby: take over the run when workers lose the primary coordinator "
    "and reconnect here.",
)
@click.option(
    "--primary",
    default=None,
    help="A standby's probe address of the primary (HOST:PORT of its channel), checked "
    "before taking over (default: the channel the primary recorded with its lease).",
)
@click.option(
    "--expected-workers",
    type=int,
    default=None,
    help="Workers to wait for before the first membership epoch (default: config).",
)
@click.option(
    "--host",
    default=None,
    help="Address every listener (channel, store) binds, and no other "
    "[default: cluster.host]. The standby gives its own host's address here.",
)
@click.option(
    "--advertise",
    default=None,
    help="Address workers dial to reach this coordinator, written to the ports file "
    "[default: cluster.advertise, else --host].",
)
@click.option(
    "--channel-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="TCP port of the control channel, what workers' --coordinator HOST:PORT names; "
    "0: a free one [default: cluster.channel_port].",
)
@click.option(
    "--store-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="TCP port of the run's store; 0: a free one [default: cluster.port].",
)
@click.option(
    "--no-summary",
    is_flag=True,
    help="Do not write summary.json and report.html when the run ends (a launcher that "
    "writes them itself).",
)
def coordinator(
    config_toml: str | None,
    config_json: str | None,
    run_dir: str,
    ports_file: str | None,
    resume: str | None,
    allow_config_change: bool,
    standby: bool,
    primary: str | None,
    expected_workers: int | None,
    host: str | None,
    advertise: str | None,
    channel_port: int | None,
    store_port: int | None,
    no_summary: bool,
) -> None:
    """Run a coordinator (membership, failure detection, plans). Token from $PERDURE_RUN_TOKEN.

    It ends with the run (exit 0): when every member is done, or, for an idle standby,
    when the primary logs the run's end. The coordinator that ran the run to its end
    then writes RUN_DIR/summary.json and RUN_DIR/report.html."""
    import time

    from perdure.config.errors import ConfigError
    from perdure.lifecycle import die_with_parent
    from perdure.proctitle import set_title
    from perdure.run_config import config_from_dict, load_config
    from perdure.runtime.control.address import coordinator_endpoints
    from perdure.runtime.control.coordinator import Coordinator
    from perdure.runtime.control.lease import LeaseHeld, LeaseStoreError

    die_with_parent()  # started by a launcher: end with it (no-op when started by hand)
    set_title("standby" if standby else "coordinator", run_dir=run_dir)

    if (config_toml is None) == (config_json is None):
        raise click.UsageError("give exactly one of --config (TOML) and --config-json")
    try:
        if config_toml is not None:
            config = load_config(config_toml)
        else:
            assert config_json is not None
            with open(config_json) as f:
                config = config_from_dict(json.load(f), source=config_json)
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
    try:
        endpoints = coordinator_endpoints(
            config.cluster,
            host=host,
            advertise=advertise,
            channel_port=channel_port,
            store_port=store_port,
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--host") from None
    started = time.time()
    token = _token()
    try:
        c = Coordinator(
            config,
            run_dir=run_dir,
            token=token,
            resume=resume,
            allow_config_change=allow_config_change,
            endpoints=endpoints,
            expected_workers=expected_workers,
            standby=standby,
            primary=primary,
        )
    except (LeaseHeld, LeaseStoreError) as e:
        click.echo(f"coordinator not started: {e}", err=True)
        sys.exit(2)
    except OSError as e:
        click.echo(f"perdure coordinator: {e}", err=True)
        sys.exit(2)
    # SIGTERM (a launcher or cluster manager asking for a clean stop): drain the run at a
    # step boundary with a final checkpoint. SIGINT: stop serving now.
    signal.signal(signal.SIGTERM, lambda *_: c.request_drain("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: c.stop())
    if ports_file:
        tmp = ports_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "host": c.host,
                    "bind": c.endpoints.bind,
                    "store_port": c.store_port,
                    "channel_port": c.channel_port,
                    "metrics_port": c.metrics.port,  # Prometheus (None: off or not bound)
                    "pid": os.getpid(),
                },
                f,
            )
        os.replace(tmp, ports_file)
    c.serve()
    if c.policy.finished and not c.policy.fenced and not no_summary:
        _write_summary(config, run_dir, started)
    # 0: the run ended (complete, drained or failed; or, for an idle standby, under the
    # primary); 3: fenced out by a newer generation
    _exit(3 if c.policy.fenced else 0 if c.policy.finished or c.run_over else 130)


def _write_summary(config: RunConfig, run_dir: str, started: float) -> None:
    """summary.json and report.html, whatever started this coordinator (the events of
    this launch only: those stamped since it started)."""
    from pathlib import Path

    from perdure.launch.summary import write_summary
    from perdure.report import write_report

    try:
        write_summary(Path(run_dir), config, started=started)
        write_report(run_dir)
    except Exception as e:  # the run is over either way: one line, not a traceback
        click.echo(f"perdure coordinator: summary or report not written: {e}", err=True)
