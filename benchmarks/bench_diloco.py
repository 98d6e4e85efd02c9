"""DiLoCo against the synchronous hierarchical step on four shaped regions: tokens per
second, bytes across regions per token, and held-out loss against tokens and wall time.

    .venv/bin/python benchmarks/bench_diloco.py            # sync, H = 10, 50, 200; fp32, int8
    .venv/bin/python benchmarks/bench_diloco.py --quick    # sync, H = 50 fp32 and int8
    .venv/bin/python benchmarks/bench_diloco.py --no-sync --inner-steps 50 --delays 0 1
                                          # H = 50, each beside its overlapped twin

Needs root (namespaces, a TUN device, ``tc``). The hosts and the router are the tests'
(``tests/netns_regions.py``): one bridge per region, every packet between regions goes
through a router namespace and a user-space delay line (``--rtt-ms``), nothing added inside
a region. The links between regions are shaped with tbf (``--rate-mbit``) on both ends
of each region's link to the router: the router's side (what enters the region) and the
bridge's side (what leaves it), so every region's uplink and downlink are held to the
rate; links inside a region are not shaped. One worker per region on a host of its own,
the coordinator on a host of its own in region r0; each run is a real cluster started
with the documented commands from a TOML config (``cluster.regions`` lists the regions).

Both modes train tiny_lm on the same data for the same tokens: the synchronous step
``--steps`` times (the default reduction, exact with streamed exponents, in two tiers:
``cluster.hierarchical_reduce``), DiLoCo ``--steps / H`` outer steps of H inner steps
(``[outer]``, R = 4 virtual replicas: one per region). Measured per run:

- tokens/s: tokens of the steps past the warm-up over their summed ``step_s``
  (metrics.jsonl; a DiLoCo step is an outer step: H x the global batch's tokens);
- bytes across regions: the tx byte counters of the router's four region links, sampled
  every 0.25 s (everything that crossed a region boundary, both ways, the control plane
  included); per token, the bytes from the first membership epoch's start (its
  ``epoch_started`` event) to the final checkpoint's (``checkpoint_saved``), so the
  start-up (joins, the store) and the shutdown are left out of both modes
  (``cross_region_bytes`` keeps the whole run's);
- held-out loss (``[eval]``, a second data set) at the same token counts, against tokens
  and against the run's wall time so far (summed ``step_s``); the plot
  ``benchmarks/results/diloco.svg`` shows both modes.

DiLoCo's outer step here is ``--outer-lr 1.0 --outer-momentum 0.5`` (the DiLoCo paper's
0.7 / 0.9 is for runs of thousands of outer steps: on this run of 8 outer steps at H = 50
a loopback sweep gave held-out losses 2.651 (0.7/0.9), 2.630 (0.7/0.8), 2.620 (0.7/0.6),
2.619 (0.9/0.7), 2.591 (1.0/0.5), 2.588 (1.0/0.3), 2.624 (1.2/0.5), 2.710 (1.0/0.9), against
the synchronous run's 2.494). The inner optimizer's state starts fresh at every outer step
(docs/architecture.md, "DiLoCo"). ``shaper_drops`` counts the packets the tbf queues
dropped: TCP sends them again, so they are in the byte counters twice. The control plane
(heartbeats every ``cluster.heartbeat_ms``, the coordinator's messages) crosses regions at
a rate per second, not per token: ``data_bytes_per_token`` leaves it out (the rate is the
quietest quarter of a DiLoCo run's 0.25 s intervals, where only it crosses), for both
modes; ``cross_region_bytes_per_token`` keeps it. The first sends are also split by
connection (``first_send.conns``) into the control plane (the coordinator's channel and
store ports: ``control_bytes``) and the data plane (``data_plane_bytes``), measured, not
estimated; two run lengths tell a run's fixed bytes from an outer step's
(docs/performance.md section 18c). With ``--delays 0 1`` each DiLoCo row has an
``outer.delay = 1`` twin (``_overlap``: the outer reduction behind the next step's
replicas) with ``tokens_per_s_vs_delay0`` and ``window_tokens_per_s_vs_delay0`` (the
tokens over the wall time from the first epoch to the final checkpoint: step times leave
out an overlapped run's last reduction and one waited for at a fingerprint comparison).

The machine has 2 shared cores for 5 processes and the delay line: the absolute rates are
this machine's; the ratio is what the wire makes of the same compute. Results:
``benchmarks/results/diloco.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, RESULTS, machine, unwind_on_sigterm, write_result

REGIONS = 4
TOKEN = "bench-diloco-token"
GOAL = (
    "DiLoCo H = 50: >= 5x the synchronous step's tokens/s, held-out loss at equal tokens "
    "within 5 %; bytes across regions per token <= 1/H of sync (fp32), <= 1/(4H) (int8)"
)
MODEL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "max_len": 64}


def modes(quick: bool, hs: list[int] | None, precisions: list[str], sync: bool,
          delays: tuple[int, ...] = (0,), crosses: tuple[str, ...] = ("auto",),
          wires: tuple[str, ...] = ("zlib",)
          ) -> list[tuple[str, int, str, int, str, str]]:  # fmt: skip
    """(name, H, precision, outer.delay, cluster.cross_region_reduce,
    outer.wire_compression); H = 1 is the synchronous step (``auto``: the direct
    exchange). Several ``crosses`` (``wires``, int8 rows only): each DiLoCo row once per
    setting, one right after the other (the same load), named by it."""
    out = [("sync", 1, "fp32", 0, "auto", "zlib")] if sync else []
    for h in hs if hs is not None else ([50] if quick else [10, 50, 200]):
        for p in precisions:  # each overlapped row right after its twin: the same load
            for d in delays:
                for c in crosses:  # the settings before "_overlap": derive()'s twin
                    for w in wires if p == "int8" else wires[:1]:
                        tag = f"_{c}" if len(crosses) > 1 else ""
                        tag += f"_{w}" if p == "int8" and len(wires) > 1 else ""
                        name = f"diloco_h{h}_{p}{tag}{'_overlap' if d else ''}"
                        out.append((name, h, p, d, c, w))
    return out


def run_config(dataset: Path, held_out: Path, h: int, precision: str, steps: int,
               coordinator: str, ports: int, exponents: str = "step",
               outer: tuple[float, float] = (1.0, 0.5), delay: int = 0,
               cross: str = "auto", wire: str = "zlib") -> Any:  # fmt: skip
    """The run's config: the same model, data, batch and tokens in both modes (DiLoCo's
    exponents ``step`` by default, as configs/diloco.toml: an outer step is rare, so one
    small MAX round before its sum costs less than the streamed form's first outer step
    computed twice). ``delay`` 1: ``outer.delay = 1``, each outer step's reduction behind
    the next step's replicas (the overlapped rows). ``cross``: how the regions' leaders
    combine (``cluster.cross_region_reduce``: not part of the math); ``wire``: int8's
    ``outer.wire_compression`` (not part of the math either)."""
    from tests.runtime_support import small_config

    outer_steps = max(1, steps // h)
    sections: dict[str, Any] = {
        "task": {"options": MODEL},
        "cluster": {
            "hierarchical_reduce": True,
            "cross_region_reduce": cross,
            "host": coordinator,
            "channel_port": ports,
            "port": ports + 1,
            "replace_after_ms": -1,
            "min_collective_timeout_ms": 60000,
        },
        "checkpoint": {"every_steps": 10**6, "keep_last": 1},
        "eval": {
            "dataset": str(held_out),
            "every_steps": 1 if h > 1 else max(1, steps // 20),
            "samples": 64,
            "batch_size": 32,
        },
    }
    if h > 1:
        lr, momentum = outer
        sections["outer"] = {"replicas": REGIONS, "inner_steps": h, "precision": precision,
                             "lr": lr, "momentum": momentum, "delay": delay,
                             "wire_compression": wire}  # fmt: skip
        sections["train"] = {"reduction_exponents": exponents}
    return small_config(
        dataset,
        workers=REGIONS,
        regions=REGIONS,
        steps=outer_steps if h > 1 else steps,
        slots=REGIONS if h > 1 else 8,
        batch=16,
        **sections,
    )


def shape(rs: Any, rate_mbit: float) -> list[str]:
    """tbf on both ends of every region's link to the router (see the module's doc)."""
    if rate_mbit <= 0:
        return []
    # The links carry 65000-byte frames (tests/netns_regions.MTU): the bucket must hold two.
    q = ["root", "tbf", "rate", f"{rate_mbit:g}mbit", "burst", "160kb", "latency", "400ms"]
    done = []
    for r in range(REGIONS):
        for pre, dev in ((["-n", rs.router], f"rv{r}"), ([], f"pdr{rs.tag}{r}")):
            cmd = ["tc", *pre, "qdisc", "replace", "dev", dev, *q]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)
            done.append(" ".join(cmd))
    return done


def drops(rs: Any) -> int:
    """Packets the shaped queues have dropped (each one resent by TCP: in the byte
    counters twice)."""
    total = 0
    for r in range(REGIONS):
        for pre, dev in ((["-n", rs.router], f"rv{r}"), ([], f"pdr{rs.tag}{r}")):
            out = subprocess.run(["tc", *pre, "-s", "-j", "qdisc", "show", "dev", dev],
                                 capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            total += sum(q.get("drops", 0) for q in json.loads(out or "[]"))
    return total


def cross_bytes(rs: Any) -> int:
    """Bytes the router has sent into the regions: every byte that crossed a boundary."""
    out = subprocess.run(["ip", "-n", rs.router, "-s", "-j", "link", "show"], check=True,
                         capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    return sum(
        link["stats64"]["tx"]["bytes"]
        for link in json.loads(out)
        if link["ifname"].startswith("rv")
    )


class Counter(threading.Thread):
    """The router's byte counters sampled every ``period_s`` with their wall-clock time,
    so the bytes of a window of the run (its training, not its start-up) can be told."""

    def __init__(self, rs: Any, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.rs, self.period_s = rs, period_s
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), cross_bytes(self.rs)))
            self.done.wait(self.period_s)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)
        self.samples.append((time.time(), cross_bytes(self.rs)))

    def idle_rate(self, t0: float, t1: float) -> float:
        """Bytes per second of the quietest quarter of the sampling intervals in
        ``[t0, t1]``: with DiLoCo most intervals carry only the control plane (heartbeats,
        the coordinator's messages), whose rate this is."""
        pts = [(ts, b) for ts, b in self.samples if t0 <= ts <= t1]
        pairs = itertools.pairwise(pts)
        rates = sorted((b2 - b1) / (t2 - t1_) for (t1_, b1), (t2, b2) in pairs)
        return rates[len(rates) // 4] if rates else 0.0

    def at(self, t: float) -> int:
        """The counter's last reading at or before ``t`` (the first one if none)."""
        before = [b for ts, b in self.samples if ts <= t]
        return before[-1] if before else self.samples[0][1]


class Sniffer(threading.Thread):
    """``_tcp_payload.py`` in the router's namespace on its region links (``rv*``): the
    TCP payload that crossed a region boundary, first sends told from resends, sampled
    every ``period_s`` with its wall-clock time (as :class:`Counter`). ``control``: the
    first sends of connections to or from the coordinator's ``control_ports`` (its channel
    and its store: heartbeats, notices, group formation), the rest being the data plane
    (gloo's pairs)."""

    def __init__(self, rs: Any, period_s: float = 0.25, control_ports: tuple[int, ...] = ()
                 ) -> None:  # fmt: skip
        self.control_ports = set(control_ports)
        super().__init__(daemon=True)
        script = str(Path(__file__).parent / "_tcp_payload.py")
        argv = ["ip", "netns", "exec", rs.router, PY, script, "--prefix", "rv",
                "--period", str(period_s)]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)  # fmt: skip
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the TCP payload sniffer did not start")
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.conns: list[tuple[float, dict[str, int]]] = []
        """Each sample's first sends per connection direction into the regions."""
        self.drops = 0

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            got = json.loads(line)
            totals = {"first": 0, "payload": 0, "wire": 0}
            for link in got["links"].values():  # into the regions: the router's sends
                for k in totals:
                    totals[k] += link.get("out", {}).get(k, 0)
            totals["control"] = 0
            conns: dict[str, int] = {}
            for link in got.get("conns", {}).values():
                for key, n in link.get("out", {}).items():
                    conns[key] = conns.get(key, 0) + n
                    ends = key.split(">")
                    if any(int(e.rsplit(":", 1)[1]) in self.control_ports for e in ends):
                        totals["control"] += n
            self.samples.append((got["t"], totals))
            self.conns.append((got["t"], conns))
            self.drops = got["drops"]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        self.join(timeout=10)

    def at(self, t: float) -> dict[str, int]:
        """The counts' last reading at or before ``t`` (the first one if none)."""
        before = [c for ts, c in self.samples if ts <= t]
        return before[-1] if before else self.samples[0][1]

    def conns_between(self, t0: float, t1: float) -> dict[str, int]:
        """First sends per connection direction in ``[t0, t1]`` (the readings at or before
        each), the largest first."""

        def at(t: float) -> dict[str, int]:
            before = [c for ts, c in self.conns if ts <= t]
            return before[-1] if before else {}

        a, b = at(t0), at(t1)
        delta = {k: n - a.get(k, 0) for k, n in b.items() if n - a.get(k, 0)}
        return dict(sorted(delta.items(), key=lambda kv: -kv[1]))

    def idle_rate(self, t0: float, t1: float) -> float:
        """First-send bytes per second of the quietest quarter of the intervals in
        ``[t0, t1]`` (the control plane's rate, as :meth:`Counter.idle_rate`)."""
        pts = [(ts, c["first"]) for ts, c in self.samples if t0 <= ts <= t1]
        rates = sorted((b2 - b1) / (t2 - t1_) for (t1_, b1), (t2, b2) in itertools.pairwise(pts))
        return rates[len(rates) // 4] if rates else 0.0


def _start(rs: Any, i: int, argv: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PERDURE_RUN_TOKEN": TOKEN}
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PERDURE_PARENT_PID", None)
    return rs.start(i, [PY, "-m", "perdure", *argv], env=env, cwd=cwd, log=log)


def one_run(rs: Any, cfg: Any, name: str, h: int, tmp: Path, ports: int, warmup: int,
            timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """One cluster run; its rates, bytes across regions and held-out curve."""
    from perdure.events import read_jsonl
    from tests.runtime_support import write_toml

    path = write_toml(cfg, tmp / "run.toml")
    run_dir, logs, coord = tmp / "run", tmp / "logs", rs.hosts[0].address
    counter, dropped = Counter(rs), drops(rs)
    counter.start()
    sniffer = Sniffer(rs, control_ports=(ports, ports + 1))
    sniffer.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start(rs, 0, ["coordinator", "--config", str(path), "--run-dir",
                                    str(run_dir)], logs / "coordinator.log", tmp))  # fmt: skip
        for i in range(1, len(rs.hosts)):
            r = rs.region_of[i]
            argv = ["worker", "--coordinator", f"{coord}:{ports}", "--name", f"r{r}",
                    "--region", f"r{r}"]  # fmt: skip
            procs.append(_start(rs, i, argv, logs / f"r{r}.log", tmp))
        end = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
    except BaseException:  # interrupted (SIGTERM, Ctrl-C): nothing of the run outlives it
        counter.stop()
        sniffer.stop()
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    counter.stop()
    time.sleep(0.5)  # a last sample past the run's end
    sniffer.stop()
    dropped = drops(rs) - dropped
    crossed = counter.samples[-1][1] - counter.samples[0][1]
    log = read_jsonl(run_dir / "events.jsonl")
    started_ev = [e for e in log if e["event"] == "epoch_started"]
    started = [e["t"] for e in started_ev]
    ended = [e["t"] for e in log if e["event"] == "checkpoint_saved"] or [time.time()]
    training = counter.at(max(ended)) - counter.at(started[0]) if started else None
    window_s = max(ended) - started[0] if started else None
    idle = counter.idle_rate(started[0], max(ended)) if started else None
    lines = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    steps = sorted((m for m in lines if "step_s" in m), key=lambda m: m["step"])
    tokens_per_step = cfg.train.global_batch * seq_len(cfg) * h
    timed = [m["step_s"] for m in steps[warmup:]]
    wall, curve = 0.0, []
    evals = {m["eval_step"]: m for m in lines if "eval_step" in m}
    for m in steps:
        wall += m["step_s"]
        e = evals.get(m["step"])
        if e is not None:
            loss = e.get("eval/loss")
            curve.append({"tokens": (m["step"] + 1) * tokens_per_step, "wall_s": round(wall, 3),
                          "loss": loss})  # fmt: skip
    total_tokens = len(steps) * tokens_per_step
    # first sends, from the first epoch with every region's worker (a run whose first
    # epoch starts without one steps with fewer leaders, and fewer bytes, until it joins)
    full = [e for e in log if e["event"] == "epoch_started"
            and len(e.get("plan", {}).get("members", ())) == REGIONS]  # fmt: skip
    first_send = None
    if full and sniffer.samples:
        t0, t1, s0 = full[0]["t"], max(ended), int(full[0]["start_step"])
        a, b = sniffer.at(t0), sniffer.at(t1)
        n = len([m for m in steps if m["step"] >= s0])
        delta = {k: b[k] - a[k] for k in a}
        first_send = {
            "from_step": s0,
            "control_bytes": delta["control"],
            "data_plane_bytes": delta["first"] - delta["control"],
            "data_plane_bytes_per_step": round((delta["first"] - delta["control"]) / n, 1)
            if n
            else None,
            "conns": sniffer.conns_between(t0, t1),
            "steps": n,
            "window_s": round(t1 - t0, 2),
            "bytes": delta["first"],
            "resent_payload_bytes": delta["payload"] - delta["first"],
            "wire_bytes": delta["wire"],
            "idle_bytes_per_s": round(sniffer.idle_rate(t0, t1), 1),
            "tokens": n * tokens_per_step,
            "bytes_per_step": round(delta["first"] / n, 1) if n else None,
            "bytes_per_token": round(delta["first"] / (n * tokens_per_step), 3) if n else None,
            # the whole window's rate: every step, evaluations, the last reduction and the
            # final save included (tokens_per_s sums the steps' own step_s)
            "window_tokens_per_s": round(n * tokens_per_step / (t1 - t0), 1) if n else None,
            "capture_drops": sniffer.drops,
        }
    return {
        "mode": name,
        "inner_steps": h,
        "outer_delay": cfg.outer.delay if h > 1 else None,
        "ok": codes == [0] * len(procs) and len(steps) == cfg.train.steps,
        "exit_codes": codes,
        "steps": len(steps),
        "tokens": total_tokens,
        "tokens_per_s": round(len(timed) * tokens_per_step / sum(timed), 1) if timed else None,
        "step_s_median": statistics.median(timed) if timed else None,
        "step_s_each": [m["step_s"] for m in steps],
        "cross_region_bytes": crossed,
        "cross_region_bytes_training": training,
        "shaper_drops": dropped,
        "training_window_s": round(window_s, 2) if window_s is not None else None,
        "idle_bytes_per_s": round(idle, 1) if idle is not None else None,
        "cross_region_bytes_per_token": (
            round(training / total_tokens, 2) if total_tokens and training is not None else None
        ),
        "final_eval_loss": curve[-1]["loss"] if curve else None,
        "first_send": first_send,
        "first_epoch_members": (
            len(started_ev[0].get("plan", {}).get("members", ())) if started_ev else None
        ),
        "curve": curve,
    }


def seq_len(cfg: Any) -> int:
    from perdure.data import Dataset

    return int(Dataset.open(cfg.data.dataset).seq_len)


def derive(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each DiLoCo row against the synchronous one: speed, bytes and loss ratios; each
    overlapped row (``outer.delay = 1``) against its delay-0 twin: speed."""
    for r in rows:
        twin = next((q for q in rows if q["mode"] == r["mode"].removesuffix("_overlap")
                     and q is not r), None)  # fmt: skip
        if r.get("outer_delay") and twin is not None and r["ok"] and twin["ok"]:
            r["tokens_per_s_vs_delay0"] = round(r["tokens_per_s"] / twin["tokens_per_s"], 3)
            f, g = r.get("first_send"), twin.get("first_send")
            if f and g and f["window_tokens_per_s"] and g["window_tokens_per_s"]:
                ratio = f["window_tokens_per_s"] / g["window_tokens_per_s"]
                r["window_tokens_per_s_vs_delay0"] = round(ratio, 3)
    sync = next((r for r in rows if r["inner_steps"] == 1), None)
    if sync is None:
        return {}
    # the control plane's rate: the quietest DiLoCo run's idle intervals (between outer
    # steps only heartbeats cross); the same processes, the same rate, in every run
    idle = [r["idle_bytes_per_s"] for r in rows if r["inner_steps"] > 1 and r["ok"]]
    control = min(idle) if idle else 0.0
    for r in rows:
        if r["ok"] and r["cross_region_bytes_training"] is not None:
            data = r["cross_region_bytes_training"] - control * r["training_window_s"]
            r["data_bytes_per_token"] = round(data / r["tokens"], 2)
    # the same for the first sends: the quietest DiLoCo run's first-send rate
    idle = [r["first_send"]["idle_bytes_per_s"] for r in rows
            if r["inner_steps"] > 1 and r["ok"] and r.get("first_send")]  # fmt: skip
    first_control = min(idle) if idle else 0.0
    for r in rows:
        f = r.get("first_send")
        if r["ok"] and f and f["steps"]:
            data = f["bytes"] - first_control * f["window_s"]
            f["data_bytes_per_step"] = round(data / f["steps"], 1)
            f["data_bytes_per_token"] = round(data / f["tokens"], 3)
    for r in rows:
        if r is sync or not r["ok"] or not sync["ok"]:
            continue
        r["speedup"] = round(r["tokens_per_s"] / sync["tokens_per_s"], 2)
        r["bytes_per_token_vs_sync"] = round(
            r["cross_region_bytes_per_token"] / sync["cross_region_bytes_per_token"], 5
        )
        r["data_bytes_per_token_vs_sync"] = round(
            r["data_bytes_per_token"] / sync["data_bytes_per_token"], 5
        )
        r["bytes_bound"] = 1 / r["inner_steps"] / (4 if "int8" in r["mode"] else 1)
        f, fs = r.get("first_send"), sync.get("first_send")
        if f and fs and f["steps"] and fs["steps"]:
            for k in ("bytes_per_token", "data_bytes_per_token"):
                r[f"first_send_{k}_vs_sync"] = round(f[k] / fs[k], 6)
            # per outer step against a synchronous step: 1 (fp32), 1/4 (int8) by design
            r["first_send_step_vs_sync"] = round(f["bytes_per_step"] / fs["bytes_per_step"], 5)
            r["first_send_data_step_vs_sync"] = round(
                f["data_bytes_per_step"] / fs["data_bytes_per_step"], 5
            )
        r["loss_vs_sync"] = round(r["final_eval_loss"] / sync["final_eval_loss"], 4)
    h50 = [r for r in rows if r["inner_steps"] == 50 and "speedup" in r]
    return {
        "control_plane_bytes_per_s": control,
        "control_plane_first_send_bytes_per_s": first_control,
        "h50_speedup_ge_5": all(r["speedup"] >= 5 for r in h50) if h50 else None,
        "h50_loss_within_5pct": all(r["loss_vs_sync"] <= 1.05 for r in h50) if h50 else None,
        "bytes_bounds_met": all(
            r["bytes_per_token_vs_sync"] <= r["bytes_bound"] for r in rows if "speedup" in r
        ),
        "data_bytes_bounds_met": all(
            r["data_bytes_per_token_vs_sync"] <= r["bytes_bound"] for r in rows if "speedup" in r
        ),
        "first_send_bytes_bounds_met": all(
            r["first_send_bytes_per_token_vs_sync"] <= r["bytes_bound"]
            for r in rows
            if "first_send_bytes_per_token_vs_sync" in r
        ),
        "first_send_data_bytes_bounds_met": all(
            r["first_send_data_bytes_per_token_vs_sync"] <= r["bytes_bound"]
            for r in rows
            if "first_send_data_bytes_per_token_vs_sync" in r
        ),
    }


def svg(rows: list[dict[str, Any]], path: Path) -> None:
    """Held-out loss against tokens (left) and against wall time (right), one line a run."""
    w, h, pad = 420, 300, 45
    colours = ["#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    pts = [p for r in rows for p in r["curve"]]
    if not pts:
        return
    lo, hi = min(p["loss"] for p in pts), max(p["loss"] for p in pts)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * w}" height="{h + 40}" '
             'font-family="sans-serif" font-size="11">']  # fmt: skip
    for panel, key, label in ((0, "tokens", "tokens"), (1, "wall_s", "wall time (s)")):
        x0 = panel * w
        xmax = max(p[key] for p in pts) or 1
        parts.append(f'<rect x="{x0 + pad}" y="10" width="{w - 2 * pad}" height="{h - pad}" '
                     'fill="none" stroke="#888"/>')  # fmt: skip
        parts.append(f'<text x="{x0 + w / 2}" y="{h + 5}" text-anchor="middle">{label}</text>')
        parts.append(f'<text x="{x0 + 5}" y="20">{hi:.2f}</text>')
        parts.append(f'<text x="{x0 + 5}" y="{h - pad + 10}">{lo:.2f}</text>')
        for i, r in enumerate(rows):
            xy = [
                (x0 + pad + (w - 2 * pad) * p[key] / xmax,
                 10 + (h - pad) * (hi - p["loss"]) / ((hi - lo) or 1))
                for p in r["curve"]
            ]  # fmt: skip
            line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            c = colours[i % len(colours)]
            parts.append(f'<polyline fill="none" stroke="{c}" points="{line}"/>')
            if panel == 0:
                parts.append(f'<text x="{2 * w - 150}" y="{30 + 14 * i}" fill="{c}">'
                             f'{r["mode"]}</text>')  # fmt: skip
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inner-steps", type=int, nargs="*", help="the H values (default 10 50 200)")
    ap.add_argument("--steps", type=int, default=400, help="synchronous steps (tokens)")
    ap.add_argument("--rate-mbit", type=float, default=20.0, help="each region's link")
    ap.add_argument("--rtt-ms", type=float, default=40.0, help="between regions")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the rates")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run")
    ap.add_argument("--exponents", choices=["step", "streamed"], default="step",
                    help="DiLoCo's train.reduction_exponents")  # fmt: skip
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    ap.add_argument("--no-sync", action="store_true", help="DiLoCo rows only")
    ap.add_argument("--delays", type=int, nargs="+", default=[0], choices=[0, 1],
                    help="outer.delay of the DiLoCo rows (1: the overlapped rows)")  # fmt: skip
    ap.add_argument("--outer-lr", type=float, default=1.0, help="outer.lr")
    ap.add_argument("--outer-momentum", type=float, default=0.5, help="outer.momentum")
    ap.add_argument(
        "--cross",
        nargs="+",
        default=["auto"],
        choices=["auto", "direct", "ring"],
        help="cluster.cross_region_reduce of the DiLoCo rows (several: side by side)",
    )
    ap.add_argument(
        "--wire",
        nargs="+",
        default=["zlib"],
        choices=["zlib", "none"],
        help="outer.wire_compression of the int8 rows (several: side by side)",
    )
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    from tests.netns_regions import regions
    from tests.runtime_support import build_dataset, build_small_dataset

    # the runs' processes killed, the namespaces torn down, whatever stops it (after a
    # SIGTERM they were left behind: the regions' finally never ran)
    unwind_on_sigterm()
    rows: list[dict[str, Any]] = []
    ports = 29700
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as d:
        dataset = build_small_dataset(Path(d) / "data")
        held_out = Path(d) / "held_out"
        stdlib = Path(os.__file__).parent
        build_dataset([str(stdlib / "unittest")], str(held_out), seq_len=64, part_mb=0.05,
                      include="*.py")  # fmt: skip
        with regions([2, 1, 1, 1], rtt_ms=a.rtt_ms) as rs:
            shaped = shape(rs, a.rate_mbit)
            arms = modes(a.quick, a.inner_steps, a.precisions, not a.no_sync, tuple(a.delays),
                         tuple(a.cross), tuple(a.wire))  # fmt: skip
            for name, h, precision, delay, cross, wire in arms:
                ports += 2
                tmp = Path(d) / name
                tmp.mkdir()
                cfg = run_config(dataset, held_out, h, precision, a.steps,
                                 rs.hosts[0].address, ports, a.exponents,
                                 (a.outer_lr, a.outer_momentum), delay, cross,
                                 wire)  # fmt: skip
                row = one_run(rs, cfg, name, h, tmp, ports, a.warmup if h == 1 else 1,
                              a.timeout_s)  # fmt: skip
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
    bars = derive(rows)
    out = {
        "machine": machine(),
        "regions": REGIONS,
        "rate_mbit": a.rate_mbit,
        "rtt_ms": a.rtt_ms,
        "shaping": shaped,
        "sync_steps": a.steps,
        "outer": {"lr": a.outer_lr, "momentum": a.outer_momentum, "exponents": a.exponents},
        "cross_region_reduce": a.cross,
        "wire_compression": a.wire,
        "model": MODEL,
        "goal": GOAL,
        "bars": bars,
        "rows": rows,
    }
    svg(rows, Path(a.out).with_suffix(".svg") if a.out else RESULTS / "diloco.svg")
    print(write_result("diloco", out, a.out))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
