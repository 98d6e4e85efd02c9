"""A real multi-node Ray cluster on this machine, for the Ray launcher's tests (no tests here).

Each node is its own ``ray start --block`` (a head, then raylets joining it), in its own
session, with its own free ports and resources, under one short temporary directory (Ray's
socket paths are length-limited). Every process of the cluster carries a marker in its
environment, so that teardown stops exactly the processes this fixture started (Ray's
worker processes run in sessions of their own) and never another user's Ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.proc_support import descendants, ppid_of

MARKER = "PERDURE_TEST_RAY_CLUSTER"
READY_S = 90.0
"""How long a node may take to join (Ray's start-up on a loaded 2-core machine)."""

FAST_DEATH = {
    # A dead node is declared dead after about 3 failed 500 ms health checks instead of
    # Ray's default (tens of seconds), so that its actors are restarted within a test.
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "1000",
}


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def node_ip() -> str:
    """This machine's address on its default route, as Ray itself picks it (a UDP socket
    that is connected but sends nothing); loopback without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    labels: dict[str, str]

    def raylet_pids(self) -> list[int]:
        """The raylet this node's ``ray start`` started (found by its parent)."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if ppid_of(stat) == self.proc.pid and cmd.endswith(b"raylet"):
                out.append(int(d.name))
        return out

    def kill(self) -> None:
        """The node dies at once, as a machine does: its raylet, every process the raylet
        started (Ray's workers, our actors and their children, each in a session of its
        own) and every process of its ``ray start``."""
        doomed = set(self.raylet_pids())
        doomed |= {d for r in list(doomed) for d in descendants(r)}
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class LocalRayCluster:
    """Nodes on this machine; ``address`` is the head's GCS address."""

    root: Path
    marker: str
    ip: str = field(default_factory=node_ip)
    address: str = ""
    nodes: list[Node] = field(default_factory=list)

    def auth(self) -> dict[str, str]:
        """Ray's token authentication, with this cluster's own token file: set for the
        cluster, its drivers and any Ray they start (``ray.address = "local"``), so that
        nothing reads or writes ``~/.ray/auth_token`` (which a new local Ray creates)."""
        token = self.root / "auth_token"
        if not token.exists():
            token.write_text(secrets.token_hex(32))
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    def env(self) -> dict[str, str]:
        env = {**os.environ, MARKER: self.marker, "RAY_USAGE_STATS_ENABLED": "0", **FAST_DEATH}
        env.update(self.auth())
        repo = str(Path(__file__).resolve().parent.parent)
        paths = [repo, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.pop("RAY_ADDRESS", None)
        return env

    def start_node(self, name: str, *, region: str, cpus: int) -> Node:
        """Start a node (the head first) in ``region``, marked both ways the launcher can
        place by: the resource ``region:<region>`` and the label ``region=<region>``."""
        p = free_ports(9)
        labels = {"test-node": name, "region": region}
        resources = {f"region:{region}": 1}
        args = [
            ray_bin(), "start", "--block", "--disable-usage-stats",
            f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}",
            f"--labels=test-node={name},region={region}", f"--node-manager-port={p[0]}",
            f"--object-manager-port={p[1]}", f"--metrics-export-port={p[2]}",
            f"--dashboard-agent-listen-port={p[3]}", f"--dashboard-agent-grpc-port={p[4]}",
            f"--runtime-env-agent-port={p[5]}", "--object-store-memory=100000000",
            f"--node-ip-address={self.ip}",
        ]  # fmt: skip
        if not self.nodes:
            args += [
                "--head", f"--port={p[6]}",
                f"--dashboard-port={p[8]}", "--include-dashboard=false",
                f"--temp-dir={self.root}",
            ]  # fmt: skip
            self.address = f"{self.ip}:{p[6]}"
        else:
            args += [f"--address={self.address}"]
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (the node's lifetime)
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        node = Node(name, proc, labels)
        self.nodes.append(node)
        self._wait_started(node)  # one at a time: raylets started together can hang
        return node

    def _wait_started(self, node: Node) -> None:
        log = self.root / f"{node.name}.log"
        end = time.monotonic() + READY_S
        while time.monotonic() < end:
            if b"Ray runtime started" in log.read_bytes():
                return
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {node.proc.returncode}: {log.read_text()}")
            time.sleep(0.2)
        raise TimeoutError(f"Ray node {node.name} not started within {READY_S} s ({log})")

    def _wait_for(self, count: int, proc: subprocess.Popen[bytes]) -> None:
        end = time.monotonic() + READY_S
        while time.monotonic() < end:
            if proc.poll() is not None:
                tail = b"".join(p.read_bytes()[-1500:] for p in self.root.glob("*.log"))
                raise RuntimeError(f"ray start exited {proc.returncode}: {tail.decode()}")
            if self.alive_nodes() >= count:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{count} Ray nodes not up within {READY_S} s (see {self.root})")

    def alive_nodes(self) -> int:
        """Nodes the GCS sees alive, asked by a fresh driver process (the state CLI needs
        Ray's dashboard, which the minimal install lacks)."""
        code = (
            "import sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        with contextlib.suppress(subprocess.TimeoutExpired):
            out = subprocess.run(
                [sys.executable, "-c", code, self.address],
                capture_output=True,
                env=self.env(),
                timeout=60,
            )
            last = out.stdout.decode().strip().splitlines()[-1:] or ["0"]
            return int(last[0]) if last[0].isdigit() else 0
        return 0

    def node_hosting(self, actor_pid: int) -> Node:
        """The node whose raylet started the actor process ``actor_pid`` (Ray's worker
        processes are the raylet's children)."""
        raylet = _ppid(actor_pid)
        return next(n for n in self.nodes if raylet in n.raylet_pids())

    def stop(self) -> None:
        """Kill every node and then every process still carrying this cluster's marker, at
        once: a test cluster has nothing to save. (Ray's own stop, SIGTERM to each ``ray
        start --block``, which then stops its raylet, the GCS and the workers in turn, took
        33 s here; this takes well under one.)"""
        for node in self.nodes:
            if node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
        end = time.monotonic() + 20
        while (left := marked_processes(self.marker)) and time.monotonic() < end:
            for pid in left:  # raylets, the GCS and workers, each in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for node in self.nodes:
            node.proc.wait(timeout=20)
        if not os.environ.get("PERDURE_TEST_KEEP_RAY_LOGS"):  # set it to look at Ray's logs
            shutil.rmtree(self.root, ignore_errors=True)


def _ppid(pid: int) -> int:
    return ppid_of(Path(f"/proc/{pid}/stat").read_text())


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``MARKER=marker`` (this user's)."""
    want = f"{MARKER}={marker}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want in (d / "environ").read_bytes().split(b"\0"):
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    out.append(int(d.name))
        except OSError:
            continue
    return out


@contextlib.contextmanager
def local_ray_cluster():
    """A head (region ``r0``) and two raylets (both region ``r1``), small and short-lived.
    While it runs, this process's environment carries the cluster's authentication (a
    driver started here, or by a child, connects with it)."""
    root = Path(tempfile.mkdtemp(prefix="prd-ray-", dir="/tmp"))
    cluster = LocalRayCluster(root=root, marker=uuid.uuid4().hex)
    saved = {k: os.environ.get(k) for k in cluster.auth()}
    os.environ.update(cluster.auth())
    _refresh_ray_auth()
    try:
        cluster.start_node("head", region="r0", cpus=4)
        cluster.start_node("n1", region="r1", cpus=4)
        node = cluster.start_node("n2", region="r1", cpus=4)
        cluster._wait_for(3, node.proc)
        yield cluster
    finally:
        cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()


def _refresh_ray_auth() -> None:
    """Make an already imported Ray read the authentication settings again (it caches
    them at import; Ray's own set-up refreshes them the same way)."""
    import sys

    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def write_toml(data: dict[str, object], path: Path) -> Path:
    """``data`` (a config's plain dict) as TOML: tables, arrays of tables, scalars; None
    values are left out (TOML has no null: the field keeps its default)."""
    lines: list[str] = []

    def scalar(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        return json.dumps(v)

    def table(name: str, d: dict[str, object]) -> None:
        plain = {k: v for k, v in d.items() if v is not None and not _tabular(v)}
        lines.append(f"[{name}]")
        lines.extend(f"{json.dumps(k)} = {scalar(v)}" for k, v in plain.items())
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{name}.{k}", v)
            elif _tabular(v):
                for item in v:  # type: ignore[attr-defined]
                    lines.append(f"[[{name}.{k}]]")
                    lines.extend(
                        f"{json.dumps(a)} = {scalar(b)}" for a, b in item.items() if b is not None
                    )

    for name, section in data.items():
        table(name, section)  # type: ignore[arg-type]
    path.write_text("\n".join(lines) + "\n")
    return path


def _tabular(v: object) -> bool:
    return isinstance(v, dict) or (
        isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)
    )
