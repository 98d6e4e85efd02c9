"""The Ray launcher: a run's coordinator, standby, workers and spares as Ray actors.

Ray plays the cluster manager's part that the local launcher plays by hand: it places each
process on a node of its region (a custom resource or a node label per region, see
``RayConfig``), and when a node or an actor dies it restarts the actor on a node that
fits, where the launcher starts the replacement. Everything else stays perdure's own:
the replacement joins through the coordinator's admission like any worker (the run does
not restart), the data plane is gloo (NCCL on GPU) between the processes, not Ray's
collectives, and the monitor loop, the crash rules, chaos, the live view and
``summary.json`` are the run loop every launcher shares (``launch/supervisor.py``; this
module adds a :class:`RaySpawner`), so a run on Ray writes the same events, summary and
report, plus one ``process_placed`` event per start.

Each actor (:class:`ProcessHost`, in ``launch/ray_host.py``, a module that imports no
torch) hosts one perdure process at a time, started from the actor as ``python -m perdure
coordinator|worker`` (a worker: forked from the actor's fork server) in its own session,
rather than running perdure inside the actor's own process, because:

- signals must reach the process itself: a ``hang`` fault stops it (SIGSTOP) and resumes
  it, and a stopped actor could not be asked to resume it on another machine;
- exit codes stay exact (-9 for a kill, a positive code for an exception), which the crash
  rules and ``summary.json``'s failures read;
- perdure's processes exit without running C++ destructors (``cli/worker.py``), install
  their own signal handlers and fix their own thread counts: none of it fits inside a Ray
  worker process that Ray owns.

The process dies with its actor (``lifecycle.die_with_parent``: the actor's pid is its
parent), and every actor is owned by this driver, so Ray kills them all when the driver
exits, even by SIGKILL; the launcher also kills them at the end of the run.

Limits: the run directory must be shared storage at the same path on the driver and every
node (events, metrics, checkpoints and the ports files are read there), as must the code
(perdure, the task, the dataset path; the launcher passes its ``PYTHONPATH`` and working
directory); each worker's actor has a fork server of its own (none is shared by the
actors of a node); a pid in the event log is the pid on its node.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import perdure
from perdure import events as ev
from perdure.config.errors import ConfigError, Problem
from perdure.launch.procs import coordinator_args, wait_ports
from perdure.launch.ray_host import CALL_TIMEOUT_S, POLL_S, ProcessHost, bind_address
from perdure.launch.spawner import Proc, RunContext, Started, coordinator_names, preload_modules
from perdure.launch.supervisor import Supervisor
from perdure.run_config import RunConfig, to_dict
from perdure.run_config.launch import RayConfig
from perdure.runtime.control.address import host_port
from perdure.runtime.entry import WorkerSpec

log = logging.getLogger("perdure.launch")

PLACEMENT_AMOUNT = 0.01
"""How much of its region's custom resource a process asks for: a label-like request (a
node with ``region:R: 1`` hosts up to 100 processes), as Ray's own ``node:<ip>`` resource
is used; CPUs and GPUs do the capacity accounting."""

UNPLACED_WARN_S = 30.0
"""After this long waiting for Ray to place it, a process is named on stderr."""

RESUBMIT_S = 0.2
"""How often a start is sent again while Ray restarts its actor."""

INSTALL_HINT = "pip install 'perdure[ray]' (ray==2.60.0)"


class RayClusterError(ConfigError):
    """The Ray cluster cannot host this run (unreachable, or a region with no node to place
    its processes on); every problem at once, before any process starts."""

    def __str__(self) -> str:
        n = len(self.problems)
        lines = [f"ray cluster {self.source or ''}: {n} problem{'s' if n != 1 else ''}"]
        return "\n".join([*lines, *(f"  - {p}" for p in self.problems)])


# -- the driver's handle on one process -----------------------------------------------------


class RayProcess:
    """One process started by a :class:`ProcessHost`, seen by the launcher as a
    ``launch.procs.Process`` (what ``subprocess.Popen`` offers it).

    A start sent while Ray restarts the actor (after its node or process died) is refused
    by Ray; it is sent again every ``RESUBMIT_S`` until the actor is back, for up to
    ``start_timeout_s``, and the process counts as alive (starting) meanwhile. If the
    actor dies once the process runs, the process died with it, killed by SIGKILL
    (``die_with_parent``): its return code is -9 and ``cause`` says what Ray reported.
    Limit: an actor that Ray reports unavailable but that is only cut off for a while is
    taken for dead too; its replacement, started in the same actor, stops the old process
    first, so a name never runs twice."""

    def __init__(
        self,
        host: Any,
        launch: int,
        log_path: Path,
        *,
        args: list[str] | None = None,
        spec: WorkerSpec | None = None,
        start_timeout_s: float,
    ) -> None:
        self.host = host
        self.launch = launch
        self.start_timeout_s = start_timeout_s
        self._start_args = (launch, str(log_path))
        self._start_kwargs = {"args": args, "spec": spec.to_dict() if spec is not None else None}
        self.returncode: int | None = None
        self.cause: str | None = None
        self._placed: dict[str, Any] | None = None
        self.first_sent = time.monotonic()
        self._submit()

    def _submit(self) -> None:
        self._sent = time.monotonic()
        self._info = self.host.start.remote(*self._start_args, **self._start_kwargs)
        self._exit = self.host.wait_exit.remote(self.launch)

    # placement

    def placed(self) -> dict[str, Any] | None:
        """Where the process runs once its actor has started it, ``{"error": ...}`` if it
        could not be, None while it is starting (never blocks)."""
        import ray

        if self._placed is not None:
            return self._placed
        ready, _ = ray.wait([self._info], timeout=0)
        if not ready:
            return None
        try:
            self._placed = dict(ray.get(self._info))
        except ray.exceptions.ActorUnavailableError as e:  # restarting: send it again
            if time.monotonic() - self.first_sent > self.start_timeout_s:
                self._placed = {"error": _first_line(e)}
            elif time.monotonic() - self._sent > RESUBMIT_S:
                self._submit()
        except ray.exceptions.RayError as e:  # the actor is gone for good
            self._placed = {"error": _first_line(e)}
        return self._placed

    @property
    def pid(self) -> int:
        """The process's pid on its node; waits for the start (up to ``start_timeout_s``);
        -1 if it could not start."""
        end = self.first_sent + self.start_timeout_s + CALL_TIMEOUT_S
        while (where := self.placed()) is None:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"a Ray actor did not start its process within {self.start_timeout_s:g} s "
                    "(its region's nodes are full or gone; see ray.start_timeout_s)"
                )
            time.sleep(POLL_S)
        pid = where.get("pid")
        return int(pid) if pid is not None else -1

    # the Process protocol

    def poll(self) -> int | None:
        import ray

        if self.returncode is not None:
            return self.returncode
        where = self.placed()
        if where is None:
            return None  # starting
        if "error" in where:
            self.returncode, self.cause = -int(signal.SIGKILL), str(where["error"])
            return self.returncode
        ready, _ = ray.wait([self._exit], timeout=0)
        if ready:
            self._exited(lambda: ray.get(self._exit))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"ray process {self.launch}", timeout or 0)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Through the actor; nothing when the process is not (or no longer) running, or
        not started yet."""
        import ray

        if self.poll() is not None or self.placed() is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.host.signal.remote(self.launch, int(sig)), timeout=CALL_TIMEOUT_S)

    def abandon(self) -> None:
        """The run is over: a process its actor has not started yet never will be (the
        actor is killed next)."""
        if self.returncode is None and self.placed() is None:
            self.returncode, self.cause = -int(signal.SIGKILL), "stopped before it started"

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _exited(self, get: Any) -> None:
        import ray

        try:
            self.returncode = int(get())
        except ray.exceptions.RayError as e:  # the actor died, and the process with it
            self.returncode = -int(signal.SIGKILL)
            self.cause = _first_line(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


# -- the cluster ----------------------------------------------------------------------------


@dataclass
class RayCluster:
    """A connection to a Ray cluster checked to host the run (``connect``)."""

    address: str
    nodes: list[dict[str, Any]]
    owned: bool
    """Whether this connection is ours to close (not a caller's own ``ray.init``)."""
    runtime_env: dict[str, Any] = field(default_factory=dict)


def needed_regions(config: RunConfig) -> dict[str, float]:
    """Region -> the Ray CPUs its workers and spares reserve; coordinators' regions too
    (with 0 when no worker lives there)."""
    cl, rc = config.cluster, config.ray
    need: dict[str, float] = {r.name: r.workers * rc.worker_cpus for r in cl.regions if r.workers}
    for i in range(cl.spares):
        home = cl.regions[i % len(cl.regions)].name
        need[home] = need.get(home, 0.0) + rc.worker_cpus
    for r in (cl.coordinator_region or cl.regions[0].name, cl.standby_region):
        if r is not None:
            need.setdefault(r, 0.0)
    return need


def placement(rc: RayConfig, region: str) -> dict[str, Any]:
    """The actor options that keep a process in ``region``."""
    if rc.placement == "label":
        return {"label_selector": {rc.label: region}}
    return {"resources": {f"{rc.resource_prefix}{region}": PLACEMENT_AMOUNT}}


def in_region(rc: RayConfig, node: dict[str, Any], region: str) -> bool:
    if rc.placement == "label":
        return (node.get("Labels") or {}).get(rc.label) == region
    return float((node.get("Resources") or {}).get(f"{rc.resource_prefix}{region}", 0)) > 0


def device_problems(config: RunConfig) -> list[Problem]:
    """GPU reservations that cannot work with ``train.device`` and the data plane: Ray
    hides every GPU from an actor that reserves none (its ``CUDA_VISIBLE_DEVICES`` is
    empty), and a fraction of a GPU puts two workers on one device, which NCCL refuses.
    Pure, for tests."""
    rc, train, plane = config.ray, config.train, config.cluster.data_plane
    if train.device != "cuda":
        return []
    if rc.worker_gpus <= 0:
        rule = (
            "train.device = 'cuda' needs each worker to reserve a GPU (Ray hides the GPUs "
            "from an actor that reserves none)"
        )
        return [Problem("ray.worker_gpus", rule, rc.worker_gpus)]
    if rc.worker_gpus < 1 and plane in ("auto", "nccl"):
        rule = (
            f"a fraction of a GPU shares one device between workers, which NCCL refuses "
            f"(cluster.data_plane = {plane!r}); set cluster.data_plane = 'gloo' or reserve 1"
        )
        return [Problem("ray.worker_gpus", rule, rc.worker_gpus)]
    return []


def region_problems(config: RunConfig, nodes: list[dict[str, Any]]) -> list[Problem]:
    """What keeps the cluster's alive ``nodes`` from hosting ``config``: a region with no
    node, or with fewer CPUs (or GPUs) than its workers reserve. Pure, for tests."""
    rc = config.ray
    alive = [n for n in nodes if n.get("Alive", True)]
    what = (
        (lambda r: f"label {rc.label}={r}")
        if rc.placement == "label"
        else (lambda r: f"resource {rc.resource_prefix}{r}")
    )
    out: list[Problem] = []
    gpus = rc.worker_gpus * (config.cluster.workers + config.cluster.spares)
    have_gpus = sum(float((n.get("Resources") or {}).get("GPU", 0)) for n in alive)
    if gpus > have_gpus:
        out.append(
            Problem("ray.worker_gpus", f"the workers reserve {gpus:g} GPUs; the cluster has "
                    f"{have_gpus:g}", rc.worker_gpus)
        )  # fmt: skip
    for region, cpus in needed_regions(config).items():
        mine = [n for n in alive if in_region(rc, n, region)]
        if not mine:
            hint = (
                f"ray start --labels {rc.label}={region}"
                if rc.placement == "label"
                else f"""ray start --resources '{{"{rc.resource_prefix}{region}": 1}}'"""
            )
            out.append(
                Problem(
                    f"cluster.regions ({region})",
                    f"no alive Ray node has the {what(region)}: start its nodes with {hint}",
                    _regions_seen(rc, alive),
                )
            )
            continue
        have = sum(float((n.get("Resources") or {}).get("CPU", 0)) for n in mine)
        if cpus > have:
            out.append(
                Problem(
                    f"ray.worker_cpus ({region})",
                    f"the region's workers reserve {cpus:g} CPUs; its nodes have {have:g}",
                    rc.worker_cpus,
                )
            )
    return out


def _regions_seen(rc: RayConfig, nodes: list[dict[str, Any]]) -> list[str]:
    """What the nodes offer, to show in an error: their region resources or labels."""
    if rc.placement == "label":
        return sorted({str((n.get("Labels") or {}).get(rc.label)) for n in nodes})
    keys = {k for n in nodes for k in (n.get("Resources") or {})}
    return sorted(k for k in keys if k.startswith(rc.resource_prefix))


def code_paths() -> list[str]:
    """Where this driver found perdure and the task: the checkout perdure was imported
    from (none when it is installed) and ``$PYTHONPATH``."""
    root = str(Path(perdure.__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys([root, *paths] if "site-packages" not in root else paths))


def job_runtime_env() -> dict[str, Any]:
    """The job's runtime environment: none when Ray's workers can import perdure as they
    are (installed, or a checkout that is the driver's working directory, which Ray puts
    on its workers' path); otherwise ``PYTHONPATH`` from :func:`code_paths` (Ray then
    starts a dedicated worker process per actor: slower)."""
    root = str(Path(perdure.__file__).resolve().parent.parent)
    if "site-packages" in root or Path(root) == Path.cwd().resolve():
        return {}
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(code_paths())}}


@contextlib.contextmanager
def connect(config: RunConfig) -> Iterator[RayCluster]:
    """Connect to the cluster of ``config.ray.address`` (or start a private local one) and
    check that it can host the run; raise :class:`RayClusterError` naming each problem.
    The connection is closed on exit (a private cluster is stopped); one a caller opened
    with ``ray.init`` is used and left open."""
    try:
        import ray
    except ImportError:
        raise RayClusterError(
            [Problem("run.launcher", f"the Ray launcher needs Ray: {INSTALL_HINT}", "ray")]
        ) from None
    rc = config.ray
    owned = not ray.is_initialized()
    env = job_runtime_env()
    local = rc.address == "local"
    if owned:
        kwargs: dict[str, Any] = {
            "namespace": rc.namespace,
            "log_to_driver": False,
            "runtime_env": env or None,
        }
        if local:
            need = needed_regions(config)
            kwargs |= {
                "address": "local",
                "num_cpus": max(os.cpu_count() or 1, int(sum(need.values()) + 0.999)),
                "resources": {f"{rc.resource_prefix}{r}": 1.0 for r in need},
                "include_dashboard": False,
                "labels": {rc.label: next(iter(need))} if rc.placement == "label" else None,
            }
            kwargs = {k: v for k, v in kwargs.items() if v is not None}
        else:
            kwargs["address"] = None if rc.address == "auto" else rc.address
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayClusterError(
                [Problem("ray.address", f"cannot connect to Ray: {_first_line(e)}", rc.address)]
            ) from None
    try:
        cluster = RayCluster(
            address=rc.address,
            nodes=ray.nodes(),
            owned=owned,
            runtime_env=env,
        )
        problems = device_problems(config) + region_problems(config, cluster.nodes)
        if problems:
            raise RayClusterError(problems, source=rc.address)
        yield cluster
    finally:
        if owned:
            ray.shutdown()


# -- the launcher ---------------------------------------------------------------------------


def coordinator_command(
    config_json: Path,
    run_dir: Path,
    name: str,
    node_ip: str,
    *,
    expected: int,
    resume: str | None = None,
    allow_config_change: bool = False,
) -> list[str]:
    """The ``perdure coordinator`` arguments of coordinator ``name`` on the node at
    ``node_ip``: it binds and advertises the node's address as Ray knows it (what the
    other nodes reach it by), whatever ``cluster.host`` and ``cluster.advertise`` say, and
    writes no summary (``--no-summary``): the driver writes ``summary.json`` once every
    process has stopped and the logs are merged, as the local launcher does."""
    address = bind_address(node_ip)
    return coordinator_args(
        config_json,
        run_dir,
        resume=resume,
        name=name,
        expected=expected,
        allow_config_change=allow_config_change,
        writes_summary=True,
        host=address,
        advertise=address,
    )


class RaySpawner:
    """Starts the run's processes through one Ray actor each (a
    :class:`~perdure.launch.spawner.Spawner`): a process's handle is a
    :class:`RayProcess`, so a signal from a fault travels through its actor."""

    def __init__(self, cluster: RayCluster) -> None:
        self.cluster = cluster
        self.hosts: dict[str, Any] = {}
        """One actor per process name, created once: a replacement runs in the same
        actor, which Ray has restarted wherever its region has room if it died."""
        self._launches = itertools.count(1)
        self._unlogged: list[Proc] = []
        self._warned: set[str] = set()
        self._cwd = os.getcwd()

    # -- actors ----------------------------------------------------------------------------

    def _host(self, ctx: RunContext, name: str, region: str, kind: str) -> Any:
        """The actor of process ``name``, created on first use."""
        import ray

        if name not in self.hosts:
            rc = ctx.config.ray
            worker = kind in ("worker", "spare")
            replaces = ctx.config.cluster.replace_after_ms >= 0
            restarts = -1 if kind == "worker" and replaces else 0
            cls = ray.remote(ProcessHost).options(
                num_cpus=rc.worker_cpus if worker else 0,
                num_gpus=rc.worker_gpus if worker else 0,
                max_restarts=restarts,
                max_task_retries=0,
                **placement(rc, region),
            )
            zygote = str(ctx.run_dir / "logs" / f"zygote-{name}.log") if worker else None
            self.hosts[name] = cls.remote(
                self._cwd,
                code_paths(),
                ctx.token,
                zygote,
                run_dir=str(ctx.run_dir),
                preload=preload_modules(ctx.config),
            )
        return self.hosts[name]

    def _process(
        self,
        ctx: RunContext,
        name: str,
        region: str,
        kind: str,
        *,
        args: list[str] | None = None,
        spec: WorkerSpec | None = None,
    ) -> RayProcess:
        return RayProcess(
            self._host(ctx, name, region, kind),
            next(self._launches),
            ctx.log_of(name),
            args=args,
            spec=spec,
            start_timeout_s=ctx.config.ray.start_timeout_s,
        )

    def _place_workers(self, ctx: RunContext) -> None:
        """Create every worker's and spare's actor now, before the coordinators: Ray
        places them and their fork servers import torch while the coordinators start."""
        cl = ctx.config.cluster
        for region in cl.regions:
            for i in range(region.workers):
                self._host(ctx, f"{region.name}-{i}", region.name, "worker")
        for i in range(cl.spares):
            self._host(ctx, f"spare-{i}", cl.regions[i % len(cl.regions)].name, "spare")

    # -- processes -------------------------------------------------------------------------

    def start_coordinators(self, ctx: RunContext) -> Iterator[Started]:
        """Each coordinator started by its actor, listening on its node's address (see
        :func:`coordinator_command`), once every worker's actor is asked for."""
        cfg_path = ctx.run_dir / "config.json"
        cfg_path.write_text(json.dumps(to_dict(ctx.config), indent=2))
        self._place_workers(ctx)
        for name, region in coordinator_names(ctx.config.cluster):
            node = self._node_of(ctx, name, region)
            args = coordinator_command(
                cfg_path,
                ctx.run_dir,
                name,
                node["node_ip"],
                expected=ctx.config.cluster.workers,
                resume=ctx.resume,
                allow_config_change=ctx.allow_config_change,
            )
            popen = self._process(ctx, name, region, "coordinator", args=args)
            proc = Proc(name, region, "coordinator", popen)
            self._unlogged.append(proc)
            timeout = ctx.config.ray.start_timeout_s
            ports = wait_ports(ctx.run_dir / f"{name}.json", popen, timeout)
            channel = host_port(ports["host"], ports["channel_port"])
            yield Started(proc, channel, (ports["host"], int(ports["store_port"])))

    def _node_of(self, ctx: RunContext, name: str, region: str) -> dict[str, Any]:
        import ray

        host = self._host(ctx, name, region, "coordinator")
        timeout = ctx.config.ray.start_timeout_s
        try:
            return dict(ray.get(host.node.remote(), timeout=timeout))
        except ray.exceptions.GetTimeoutError:
            ask = placement(ctx.config.ray, region)
            raise TimeoutError(
                f"the {name}'s actor was not placed within {timeout:g} s (it asks Ray for "
                f"{ask}; see ray.start_timeout_s)"
            ) from None

    def prepare_workers(self, ctx: RunContext) -> None:
        """No fork server on the driver: each worker's actor has its own."""

    def start_worker(
        self, ctx: RunContext, name: str, region: str, role: str, gen: int, coordinators: list[str]
    ) -> RayProcess:
        spec = WorkerSpec(
            name=name,
            region=region,
            coordinators=list(coordinators),
            role=role,
            yield_cpu=gen > 0,
        )
        # the worker's data plane listens on its node's address: the actor sets spec.host
        popen = self._process(ctx, name, region, role, spec=spec)
        self._unlogged.append(Proc(name, region, role, popen, generation=gen))
        return popen

    def tick(self, ctx: RunContext) -> None:
        self._log_placements(ctx)

    def _log_placements(self, ctx: RunContext) -> None:
        """One ``process_placed`` event per started process, once its actor reports it."""
        for proc in list(self._unlogged):
            assert isinstance(proc.popen, RayProcess)
            where = proc.popen.placed()
            if where is None:
                self._warn_unplaced(ctx, proc)
                continue
            self._unlogged.remove(proc)
            ctx.events.write(
                {
                    "event": ev.PROCESS_PLACED,
                    "worker": proc.name,
                    "kind": proc.kind,
                    "region": proc.region,
                    **where,
                }
            )

    def _warn_unplaced(self, ctx: RunContext, proc: Proc) -> None:
        """Say once, on stderr, that a process waits for Ray to place it (its region's
        nodes are full or gone): the run goes on without it meanwhile."""
        assert isinstance(proc.popen, RayProcess)
        waited = time.monotonic() - proc.popen.first_sent
        if waited > UNPLACED_WARN_S and proc.name not in self._warned:
            self._warned.add(proc.name)
            log.warning(
                "%s has waited %.0f s for Ray to place it (it asks for %s)",
                proc.name, waited, placement(ctx.config.ray, proc.region),
            )  # fmt: skip

    def exit_cause(self, p: Proc) -> str | None:
        """Ray's word when the process died with its actor."""
        return p.popen.cause if isinstance(p.popen, RayProcess) else None

    def before_stop(self, ctx: RunContext, procs: list[Proc]) -> None:
        """Every handle stops resubmitting its start; the placements seen are logged."""
        for p in procs:
            if isinstance(p.popen, RayProcess):
                p.popen.abandon()
        self._log_placements(ctx)

    def close(self) -> None:
        """Kill every actor (and so any process it still hosts)."""
        import ray

        for handle in self.hosts.values():
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(handle, no_restart=True)


class RayLauncher(Supervisor):
    """Runs one training run on a Ray cluster; ``run()`` returns the summary. The shared
    run loop (:class:`~perdure.launch.supervisor.Supervisor`: monitor, crash rules,
    ``ClusterControl``, ``Roster``) with a :class:`RaySpawner`: nothing of the loop is
    overridden here, and nothing of the local launcher is inherited."""

    def __init__(
        self,
        config: RunConfig,
        run_dir: str | Path,
        *,
        cluster: RayCluster,
        **options: Any,
    ) -> None:
        super().__init__(config, run_dir, RaySpawner(cluster), **options)


__all__ = [
    "RayCluster",
    "RayClusterError",
    "RayLauncher",
    "RayProcess",
    "RaySpawner",
    "connect",
    "coordinator_command",
    "device_problems",
    "needed_regions",
    "region_problems",
]
