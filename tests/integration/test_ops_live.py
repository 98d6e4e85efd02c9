"""What an operator sees of a live run: process titles, the zygote's preload of the task
module, the coordinator's Prometheus endpoint, and the TensorBoard event files.

One run (a real launcher in its own process, real workers forked from the zygote) serves
every test of this module, in order: looking at it while it trains, killing a worker,
then stopping it with SIGTERM and reading the event files back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from perdure import events as ev
from perdure.events import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.2"  # not what the host name resolves to: only the config can say it

_LAUNCHER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tests.runtime_support import run_to_end, small_config
cfg = small_config(
    Path(sys.argv[1]), workers=2, steps=100000,
    task={"entry": "tests.import_probe_task:make_task"},
    cluster={"host": sys.argv[4]},
    metrics={"poll_ms": 100},
)
run_to_end(cfg, Path(sys.argv[2]), timeout_s=110)
"""


@dataclass
class Live:
    launcher: subprocess.Popen[bytes]
    run_dir: Path
    imports: Path

    def ports(self) -> dict:
        return json.loads((self.run_dir / "coordinator.json").read_text())

    def scrape(self, path: str = "/metrics") -> dict[str, float]:
        port = self.ports()["metrics_port"]
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5) as r:
            text = r.read().decode()
        run = f'run="{self.run_dir.resolve()}"'
        out = {}
        for line in text.splitlines():
            if line.startswith("perdure_"):
                name, _, value = line.rpartition(" ")
                assert run in name, line  # every metric names its run
                bare = name.replace(run + ",", "").replace("," + run, "")  # labels are sorted
                out[bare.replace("{" + run + "}", "")] = float(value)
        return out

    def steps(self) -> list[int]:
        return [m["step"] for m in read_jsonl(self.run_dir / "metrics.jsonl")]


def _titles() -> dict[int, str]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if text.startswith("perdure "):
            out[int(pid)] = text
    return out


def _wait(cond, what: str, live: Live, within_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + within_s
    while not cond():
        assert live.launcher.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < end, f"no {what} within {within_s} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def live(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    # The run's name is in every process title the tests look for: unique, so that a run
    # of a test running at the same time (make test: -n 2) is never taken for this one.
    rd, imports = tmp / f"live-{uuid.uuid4().hex[:12]}", tmp / "imports.txt"
    env = {**os.environ, "PERDURE_TEST_IMPORT_LOG": str(imports)}
    cmd = [sys.executable, "-c", _LAUNCHER, str(small_dataset), str(rd), str(ROOT), HOST]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=env)
    run = Live(launcher, rd, imports)
    try:
        _wait(lambda: len(run.steps()) >= 5, "committed steps", run)
        yield run
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


def _read_all(s: socket.socket) -> bytes:
    """What the server sent until it closed (a reset after its answer ends it too: it
    refused the rest of an over-long request)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def _run_name(live: Live) -> str:
    return live.run_dir.name


def test_every_process_of_a_run_names_its_role_worker_and_run(live: Live) -> None:
    mine = {t for t in _titles().values() if t.endswith(f"(run {_run_name(live)})")}
    run = f"(run {_run_name(live)})"
    assert mine == {
        f"perdure coordinator {run}",
        f"perdure zygote {run}",
        f"perdure worker r0-0 {run}",
        f"perdure worker r0-1 {run}",
    }


def test_the_zygote_imported_the_task_module_and_no_worker_did(live: Live) -> None:
    titles = _titles()
    [zygote] = [p for p, t in titles.items() if t.startswith("perdure zygote") and
                t.endswith(f"(run {_run_name(live)})")]  # fmt: skip
    pids = {int(x) for x in live.imports.read_text().split()}
    # preflight in the launcher builds the task once; the zygote imports it before forking
    assert pids == {live.launcher.pid, zygote}
    log = (live.run_dir / "logs" / "zygote.log").read_text()
    assert "preloaded 'tests.import_probe_task'" in log
    assert "import_probe_task: imported" in log  # its print went to the log, not the protocol


def test_the_endpoint_serves_the_current_step_on_the_configured_host_only(live: Live) -> None:
    port = live.ports()["metrics_port"]
    assert isinstance(port, int) and port > 0
    logged = max(live.steps())
    end = time.monotonic() + 30
    # The endpoint reads the merged logs a moment behind the writers: until it has read a
    # metrics line, its step gauge has no sample (a fast CI run scraped in that moment).
    while (m := live.scrape()).get("perdure_step", -1) < logged:
        assert time.monotonic() < end, f"the endpoint's step stayed at {m.get('perdure_step')}"
        time.sleep(0.1)
    assert m["perdure_step"] in set(live.steps())
    assert m["perdure_members"] == 2 and m["perdure_steps_target"] == 100000
    assert m['perdure_coordinator_active{role="coordinator"}'] == 1
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), 2):
        pass  # bound to cluster.host, not to every interface


def test_hostile_requests_do_not_stop_the_endpoint_or_the_coordinator(live: Live) -> None:
    port = live.ports()["metrics_port"]
    idle = socket.create_connection((HOST, port), 5)  # sends nothing: holds one thread
    payloads = [
        b"\x00\xff\xfe garbage \r\n\r\n",
        b"GET /" + b"A" * 100_000 + b" HTTP/1.1\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"X-Big: " + b"B" * 100_000 + b"\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(500)) + b"\r\n",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nxx",
        b"GET /metrics?name[]=%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    answers = []
    for data in payloads:
        with socket.create_connection((HOST, port), 5) as s:
            s.sendall(data)
            # The server may answer a refused request (an over-long line) and close before
            # the client's half-close: that is the endpoint working, not failing.
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            s.settimeout(10)
            answers.append(_read_all(s))
    idle.close()
    # a request line that is not HTTP/1.x gets http.server's HTTP/0.9 error page
    assert b"Error code: 400" in answers[0]
    status = [a.split(b"\r\n")[0] for a in answers[1:]]
    assert status == [
        b"HTTP/1.0 414 Request-URI Too Long",
        b"HTTP/1.0 431 Line too long",
        b"HTTP/1.0 431 Too many headers",
        b"HTTP/1.0 405 Method Not Allowed",
        b"HTTP/1.0 200 OK",
    ]
    before = max(live.steps())
    _wait(lambda: max(live.steps()) > before + 5, "steps after the hostile requests", live)
    assert live.scrape()["perdure_step"] >= before
    coordinator = live.ports()["pid"]
    assert os.kill(coordinator, 0) is None  # still there


def test_a_killed_worker_is_a_failure_on_the_endpoint_and_its_replacement_imports_nothing(
    live: Live,
) -> None:
    run = f"(run {_run_name(live)})"
    [victim] = [p for p, t in _titles().items() if t == f"perdure worker r0-1 {run}"]
    os.kill(victim, signal.SIGKILL)

    def replaced() -> bool:
        return any(t == f"perdure worker r0-1 {run}" and p != victim for p, t in _titles().items())

    _wait(replaced, "replacement of r0-1", live)
    key = 'perdure_failures_observed_total{kind="process_exit",scheduled="false"}'
    _wait(lambda: live.scrape().get(key) == 1, "the exit on the endpoint", live)

    def planned_in() -> bool:
        starts = [e for e in read_jsonl(live.run_dir / "events.jsonl")
                  if e["event"] == ev.EPOCH_STARTED]  # fmt: skip
        return len(starts) >= 3 and "r0-1" in starts[-1]["plan"]["members"]

    _wait(planned_in, "the replacement planned in", live)
    _wait(lambda: live.scrape()["perdure_members"] == 2, "2 members on the endpoint", live)
    assert len(live.imports.read_text().split()) == 2  # the launcher's and the zygote's


def test_tensorboard_holds_each_committed_step_once_with_the_logged_values(live: Live) -> None:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    live.launcher.send_signal(signal.SIGTERM)  # drain: a final checkpoint, a clean end
    assert live.launcher.wait(60) == 0
    metrics = read_jsonl(live.run_dir / "metrics.jsonl")
    acc = EventAccumulator(str(live.run_dir / "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    for tag, field in [("train/loss", "loss"), ("train/lr", "lr"), ("train/step_s", "step_s")]:
        points = [(e.step, e.value) for e in acc.Scalars(tag)]
        by_step = {m["step"]: m[field] for m in metrics}
        assert [s for s, _ in points] == sorted(by_step), tag  # every step, once, in order
        assert [v for _, v in points] == [np.float32(by_step[s]) for s, _ in points], tag
    epochs = [
        e for e in read_jsonl(live.run_dir / "events.jsonl") if e["event"] == ev.EPOCH_STARTED
    ]
    members = [(e.step, e.value) for e in acc.Scalars("membership/members")]
    assert members == [(e["start_step"], len(e["plan"]["members"])) for e in epochs]
    assert [e.value for e in acc.Scalars("failures/process_exit")] == [1.0]
