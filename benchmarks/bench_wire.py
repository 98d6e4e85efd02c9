"""perdure against DDP and FSDP2 on a wire-bound link: two network-namespace hosts joined by
a veth link shaped with tbf, W = 2 ranks (one per host), side by side in one script.

    flock /tmp/perdure-bench.lock .venv/bin/python benchmarks/bench_wire.py
    .venv/bin/python benchmarks/bench_wire.py --rate-mbit 0        # unshaped: CPU-bound row
    .venv/bin/python benchmarks/bench_wire.py --model 25M           # the 25M-parameter model
    .venv/bin/python benchmarks/bench_wire.py --perdure 'c32:reduction=exact,reduction_bits=32'
    .venv/bin/python benchmarks/bench_wire.py --quick               # tiny model, few steps

Needs root (namespaces, veths, tc); otherwise it says why and exits 0. The hosts are the
tests' (``tests/netns_support.py``): three namespaces on a bridge, addresses of the
private test range 10.231.x.y (nothing leaves them). Hosts 0 and 1 carry one rank each;
host 2 holds perdure's coordinator (and nothing else), so a rank's host holds only that
rank. Both ends of the veth pairs of hosts 0 and 1 get ``tc qdisc add dev X root tbf rate
R burst B latency L`` (``--rate-mbit``; 0 shapes nothing), so rank-to-rank traffic passes
one shaper of each host per direction. The raw TCP rate of each direction is measured
first with a plain socket copy.

Arms (one intra-op thread per rank, the same tiny_lm from examples, global batch 8,
seq 32, AdamW, gradient clipping at 1.0):

- ``ddp``: ``DistributedDataParallel`` on gloo, one forward/backward per step (micro 1),
  and 4 micro-batches per rank with ``no_sync`` on all but the last (micro 4);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` per transformer block and at the root
  on a CPU device mesh over gloo, micro 1 and micro 4 (gradient sync only on the last
  micro-batch: FSDP2's "accumulate locally, reduce once");
- ``perdure``: the real runtime (``perdure coordinator`` on host 2, ``perdure worker`` on
  hosts 0 and 1, the documented commands), ``train.slots`` = W (one backward per rank,
  like micro 1) and 4W (like micro 4), ``shard_degree`` 1 and 2 (2 with ``shard_params``,
  as FSDP2 shards the parameters), for each reduction config ``--perdure
  NAME:key=value,...`` (a key without a section is ``train.``; one flag per row). step_s
  from the run's ``metrics.jsonl``, the first ``--warmup`` steps dropped.
  :func:`perdure_arm` is the one function that knows how perdure is run.

Per row: step s (median, p10, p90 of the timed steps), the ratio to DDP at the same
micro-batching, bytes on the wire per step (the tx/rx byte counters of each host's
``eth0``, read inside its namespace by a sampler process every 20 ms and interpolated to
the timed window: first timed step's start to the last one's end), the wire floor (the
fp32 ring all-reduce's bytes per rank and direction, 2 (W-1)/W x 4 P, over the slower
measured direction), and per-rank peak RSS (the baselines' own VmHWM; for perdure the
largest VmHWM of the processes in the rank's namespace, polled every 0.25 s).

DDP and FSDP2 ranks take random tokens (the same shapes); perdure reads its dataset (a
seq-32 build of the stdlib's json and email packages): the compute per step is the
same. The machine: 2 cores shared with other sessions; the load average is recorded at
the start and the end. Results: ``benchmarks/results/wire.json`` (``wire_unshaped.json``
with ``--rate-mbit 0``).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, machine, unwind_on_sigterm, write_result

W = 2
GLOBAL_BATCH = 8
SEQ = 32
TOKEN = "bench-wire-token"
MODELS = {
    "5M": {"d_model": 256, "n_layers": 6, "n_heads": 4, "dropout": 0.1},
    "25M": {"d_model": 512, "n_layers": 8, "n_heads": 8, "dropout": 0.1},
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4, "dropout": 0.1},
}
DEFAULT_ROWS = [
    "streamed32:reduction=exact,reduction_bits=32,reduction_exponents=streamed",
    "chain:reduction=chain",
    "exact64:reduction=exact,reduction_bits=64,reduction_exponents=step",
    "exact32:reduction=exact,reduction_bits=32,reduction_exponents=step",
    "carried:reduction=exact,reduction_bits=64,reduction_exponents=carried",
]
RANKS = [0, 1]  # the hosts of the ranks; host 2 is the coordinator's
MICRO_OF_SLOTS = {1: 1, 4: 4}  # slots per rank -> the baselines' micro-batches per rank


# -- pure parts (tested without namespaces) ----------------------------------------------


@dataclass(frozen=True)
class PerdureRow:
    """One perdure reduction config: a name and config overrides by section."""

    name: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse_value(text: str) -> Any:
    """A TOML-ish scalar: true/false, an int, a float, else the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_row(spec: str) -> PerdureRow:
    """``NAME:key=value,key=value`` (``section.key``; a bare key is ``train.key``)."""
    name, sep, body = spec.partition(":")
    if not sep or not name.strip() or not name.strip().replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--perdure {spec!r}: expected NAME:key=value,... (NAME alphanumeric)")
    overrides: dict[str, dict[str, Any]] = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"--perdure {spec!r}: {item!r} is not key=value")
        section, dot, k = key.strip().rpartition(".")
        overrides.setdefault(section if dot else "train", {})[k] = parse_value(value)
    return PerdureRow(name.strip(), overrides)


def ring_bytes(params: int, workers: int, elem_bytes: int = 4) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``params`` values."""
    return 2 * (workers - 1) / workers * elem_bytes * params


def wire_floor_s(params: int, workers: int, rate_mbit: float) -> float | None:
    """The fp32 ring all-reduce's time at ``rate_mbit`` per direction (None: no rate)."""
    if rate_mbit <= 0:
        return None
    return ring_bytes(params, workers) * 8 / (rate_mbit * 1e6)


def step_stats(xs: list[float]) -> dict[str, float] | None:
    """Median, p10, p90 (inclusive quantiles) and n."""
    if not xs:
        return None
    q = [xs[0]] * 9 if len(xs) == 1 else statistics.quantiles(xs, n=10, method="inclusive")
    return {"median": statistics.median(xs), "p10": q[0], "p90": q[8], "n": len(xs)}


def perdure_config(model: dict[str, Any], row: PerdureRow, *, slots: int, shard_degree: int,
                   steps: int, dataset: str, host: str, ports: int) -> dict[str, Any]:  # fmt: skip
    """The run config of one perdure row (a plain dict, as a TOML file would hold it)."""
    cfg: dict[str, Any] = {
        "task": {"entry": "examples.tiny_lm.task:make_task", "options": dict(model)},
        "optim": {"name": "adamw", "lr": 1e-3, "grad_clip": 1.0},
        "train": {
            "steps": steps,
            "global_batch": GLOBAL_BATCH,
            "slots": slots,
            "threads_per_worker": 1,
            "shard_degree": shard_degree,
            "shard_params": shard_degree > 1,
        },
        "data": {"dataset": dataset},
        "cluster": {
            "regions": [{"name": "r0", "workers": W}],
            "host": host,
            "channel_port": ports,
            "port": ports + 1,
            "replace_after_ms": -1,
            "min_collective_timeout_ms": 60000,
            "slow_ratio": 20.0,
        },
        "checkpoint": {"every_steps": 0},
    }
    for section, fields in row.overrides.items():
        cfg.setdefault(section, {}).update(fields)
    return cfg


def derive(rows: list[dict[str, Any]], floor_s: float | None) -> None:
    """Ratios to DDP at the same micro-batching, bytes vs DDP's, and the wire floor."""
    ddp = {r["micro"]: r for r in rows if r["method"] == "ddp" and r.get("step_s")}
    for r in rows:
        base = ddp.get(r["micro"])
        r["wire_floor_s"] = floor_s
        if base is None or not r.get("step_s"):
            continue
        r["vs_ddp"] = r["step_s"]["median"] / base["step_s"]["median"]
        if r.get("wire_mb_per_step") and base.get("wire_mb_per_step"):
            r["bytes_vs_ddp"] = r["wire_mb_per_step"] / base["wire_mb_per_step"]


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    head = ("| method | micro / slots | k | step s (p10-p90) | vs DDP | wire MB/step (max dir) "
            "| vs DDP bytes | peak RSS MB r0/r1 |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        s = r.get("step_s")
        if not s:
            lines.append(f"| {r['label']} | {r['micro']} | {r.get('k', '-')} | "
                         f"{r.get('error', 'no steps')[:60]} | | | | |")  # fmt: skip
            continue
        rss = "/".join(f"{x:.0f}" if x else "-" for x in r.get("peak_rss_mb", []))
        lines.append(
            f"| {r['label']} | {r['micro']} | {r.get('k', '-')} | {s['median']:.3f} "
            f"({s['p10']:.3f}-{s['p90']:.3f}) | {_f(r.get('vs_ddp'))} | "
            f"{_f(r.get('wire_mb_per_step'), 1)} | {_f(r.get('bytes_vs_ddp'))} | {rss} |"
        )
    return "\n".join(lines)


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# -- the baselines' ranks (run inside the namespaces) -------------------------------------


def rank_main(spec: dict[str, Any]) -> None:  # pragma: no cover - a rank process
    """One rank of one baseline arm: build, warm up, time ``steps`` steps, report."""
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from _wire_link import vm_hwm_kb

    from examples.tiny_lm.task import TinyLM, loss_fn

    torch.set_num_threads(1)
    rank, micro = spec["rank"], spec["micro"]
    timeout = timedelta(seconds=spec["timeout_s"])
    out: dict[str, Any] = {"rank": rank}
    store = dist.TCPStore(spec["master"], spec["port"], W, rank == 0, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W, timeout=timeout)
    try:
        torch.manual_seed(1234)
        model = TinyLM(**spec["model"])
        out["params"] = sum(p.numel() for p in model.parameters())
        wrapped = _wrap(spec["method"], model)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        per = GLOBAL_BATCH // W // micro
        gen = torch.Generator().manual_seed(rank)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                toks = torch.randint(0, 256, (per, SEQ), generator=gen)
                batch = {"tokens": toks, "weight": torch.ones(per)}
                with _sync(spec["method"], wrapped, last=m == micro - 1):
                    (loss_fn(wrapped, batch) / (per * micro)).backward()
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
            opt.step()

        for _ in range(spec["warmup"]):
            step()
        dist.barrier()
        out["t_start"] = time.time()
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out["t_end"] = time.time()
        out["step_s"] = times
        dist.barrier()
    except Exception as e:  # FSDP2 "where it runs": the reason goes into the row
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    out["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["vm_hwm_mb"] = (vm_hwm_kb(os.getpid()) or 0) / 1024
    Path(spec["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def _wrap(method: str, model: Any) -> Any:  # pragma: no cover - a rank process
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (W,))
    for block in model.blocks.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sync(method: str, wrapped: Any, *, last: bool) -> Any:  # pragma: no cover - a rank
    import contextlib

    if method == "ddp":
        return contextlib.nullcontext() if last else wrapped.no_sync()
    wrapped.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


# -- the driver ---------------------------------------------------------------------------


@dataclass
class Bench:
    """What every arm needs: the hosts, the byte counters, the settings."""

    hs: Any
    counters: Any
    tmp: Path
    env: dict[str, str]
    args: argparse.Namespace
    dataset: str
    ports: int = 29600

    def next_ports(self) -> int:
        self.ports += 3
        return self.ports

    def wire(self, t0: float, t1: float, steps: int) -> dict[str, Any]:
        """Bytes per step on each rank host's eth0 over [t0, t1]."""
        per = {i: self.counters.window(i, t0, t1) for i in RANKS}
        tx = [per[i]["tx"] / steps / 1e6 for i in RANKS]
        rx = [per[i]["rx"] / steps / 1e6 for i in RANKS]
        return {"wire_mb_per_step": max(tx), "tx_mb_per_step": tx, "rx_mb_per_step": rx}


def baseline_arm(b: Bench, method: str, micro: int) -> dict[str, Any]:
    """DDP or FSDP2 at ``micro`` micro-batches per rank: one process per rank and arm
    (so each rank's peak RSS is this arm's alone)."""
    a = b.args
    port = b.next_ports()
    tag = f"{method}-m{micro}"
    procs, outs = [], []
    for rank, host in enumerate(RANKS):
        out = b.tmp / f"{tag}-r{rank}.json"
        outs.append(out)
        spec = {"rank": rank, "micro": micro, "method": method, "model": MODELS[a.model],
                "master": b.hs[RANKS[0]].address, "port": port, "steps": a.steps,
                "warmup": a.warmup, "timeout_s": a.timeout_s, "out": str(out)}  # fmt: skip
        argv = [PY, str(Path(__file__).resolve()), "--rank-spec", json.dumps(spec)]
        procs.append(b.hs.start(host, argv, env=b.env, cwd=REPO, log=b.tmp / f"{tag}-r{rank}.log"))
    codes = _wait(procs, a.timeout_s + 60)
    row: dict[str, Any] = {"method": method, "micro": micro, "exit_codes": codes,
                           "label": f"{'DDP' if method == 'ddp' else 'FSDP2'}, micro {micro}"
                           + (" (no_sync)" if method == "ddp" and micro > 1 else "")}  # fmt: skip
    res = [json.loads(o.read_text()) for o in outs if o.exists()]
    errors = [r["error"] for r in res if "error" in r]
    if len(res) < W or errors:
        log = (b.tmp / f"{tag}-r0.log").read_text()[-800:]
        row["error"] = errors[0] if errors else f"rank failed (exit {codes}): {log}"
        return row
    r0 = res[0]
    row["params"] = r0["params"]
    row["step_s"] = step_stats(r0["step_s"])
    row.update(b.wire(r0["t_start"], r0["t_end"], a.steps))
    row["peak_rss_mb"] = [r["vm_hwm_mb"] for r in res]
    return row


def perdure_arm(
    b: Bench, row: PerdureRow, slots_per_rank: int, shard_degree: int
) -> dict[str, Any]:
    """perdure's real runtime on the hosts: ``perdure coordinator`` on host 2 and ``perdure
    worker`` on each rank host, from one TOML config, as an operator starts them. Step
    time from ``metrics.jsonl`` (first ``--warmup`` steps dropped), the wire window from
    the timed steps' records (each line's ``t`` is the end of its step), peak RSS from
    the processes in each rank's namespace. The one place that knows how perdure runs:
    adapt it when the step's API changes."""
    from _wire_link import PeakRss

    from perdure.events import read_jsonl
    from perdure.run_config import config_from_dict
    from tests.runtime_support import write_toml

    a = b.args
    ports = b.next_ports()
    steps = a.warmup + a.steps
    coord = b.hs[2].address
    tag = f"perdure-{row.name}-s{slots_per_rank}-k{shard_degree}"
    out: dict[str, Any] = {"method": "perdure", "config": row.name, "k": shard_degree,
                           "micro": MICRO_OF_SLOTS[slots_per_rank], "slots": slots_per_rank * W,
                           "label": f"perdure {row.name}, slots {slots_per_rank * W}"}  # fmt: skip
    d = b.tmp / tag
    d.mkdir()
    try:
        cfg = perdure_config(MODELS[a.model], row, slots=slots_per_rank * W,
                             shard_degree=shard_degree, steps=steps, dataset=b.dataset,
                             host=coord, ports=ports)  # fmt: skip
        out["overrides"] = row.overrides
        path = write_toml(config_from_dict(cfg), d / "run.toml")
    except Exception as e:  # a config the runtime refuses: the reason is the row
        out["error"] = f"config refused: {e}"[:300]
        return out
    run_dir = d / "run"
    env = {**b.env, "PERDURE_RUN_TOKEN": TOKEN}
    rss = PeakRss(b.hs, RANKS, exclude=b.counters.pids)
    rss.start()
    argv = [PY, "-m", "perdure"]
    procs = [b.hs.start(2, [*argv, "coordinator", "--config", str(path), "--run-dir",
                            str(run_dir)], env=env, cwd=d, log=d / "coordinator.log")]  # fmt: skip
    for w, host in enumerate(RANKS):
        wargv = [*argv, "worker", "--coordinator", f"{coord}:{ports}", "--name", f"r0-{w}",
                 "--region", "r0"]  # fmt: skip
        procs.append(b.hs.start(host, wargv, env=env, cwd=d, log=d / f"r0-{w}.log"))
    out["exit_codes"] = _wait(procs, a.timeout_s)
    peaks = rss.stop()
    lines = sorted(read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["step"])
    timed = [m for m in lines if m["step"] >= a.warmup]
    if out["exit_codes"] != [0] * len(procs) or len(timed) < 2:
        tail = (d / "r0-0.log").read_text()[-600:] if (d / "r0-0.log").exists() else ""
        out["error"] = f"run failed (exit {out['exit_codes']}, {len(lines)} steps): {tail}"
        return out
    out["step_s"] = step_stats([m["step_s"] for m in timed])
    t0 = next(m["t"] for m in lines if m["step"] == a.warmup - 1) if a.warmup else timed[0]["t"]
    n = len(timed) if a.warmup else len(timed) - 1
    out.update(b.wire(t0, timed[-1]["t"], n))
    out["peak_rss_mb"] = [peaks.get(i, {}).get("peak_rss_mb") for i in RANKS]
    out["peak_rss_procs"] = peaks
    summary = run_dir / "summary.json"
    if summary.exists():
        out["final_hash"] = json.loads(summary.read_text()).get("final_hash")
    return out


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    """Wait for every process, at most ``timeout_s``; kill what is left."""
    end = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    return [p.returncode for p in procs]


def build_dataset(out: Path) -> str:
    """A seq-32 dataset from the stdlib's json and email packages (no downloads)."""
    from perdure.data import build_dataset as build
    from tests.runtime_support import STDLIB

    if not (out / "manifest.json").exists():
        build([str(STDLIB / "json"), str(STDLIB / "email")], str(out), seq_len=SEQ,
              part_mb=0.5, include="*.py")  # fmt: skip
    return str(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rate-mbit",
        type=float,
        default=200.0,
        help="tbf rate on each shaped veth end, Mbit/s (0: unshaped, CPU-bound row)",
    )
    ap.add_argument("--burst-kb", type=int, default=256, help="tbf burst, KiB")
    ap.add_argument("--tbf-latency-ms", type=int, default=50, help="tbf latency (queue), ms")
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="5M",
        help="tiny_lm size: 5M (d_model 256, 6 layers), 25M (512, 8), tiny (quick)",
    )
    ap.add_argument("--steps", type=int, default=30, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=4, help="steps dropped before timing")
    ap.add_argument(
        "--perdure",
        action="append",
        metavar="NAME:key=value,...",
        help="a perdure reduction config (repeatable; default: streamed32 (the default "
        "reduction), chain, exact64, exact32, carried); a bare key is train.<key>",
    )
    ap.add_argument(
        "--slots-per-rank",
        type=int,
        nargs="*",
        default=[1, 4],
        choices=[1, 4],
        help="perdure slots per rank (1: slots = W, 4: slots = 4W)",
    )
    ap.add_argument("--shard-degrees", type=int, nargs="*", default=[1, 2], choices=[1, 2])
    ap.add_argument("--no-fsdp2", action="store_true", help="skip the FSDP2 arms")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 3+2 steps, one perdure row at slots = W, k = 1",
    )
    ap.add_argument("--timeout-s", type=float, default=600, help="per arm, seconds")
    ap.add_argument("--out", help="result file (default benchmarks/results/wire.json)")
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the work directory (logs, run directories) and print its path",
    )
    ap.add_argument("--rank-spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    rows = a.perdure or DEFAULT_ROWS
    if a.quick:
        a.model, a.steps, a.warmup, a.shard_degrees, a.slots_per_rank = "tiny", 3, 2, [1], [1]
        rows = rows[:1]
    a.rows = [parse_row(s) for s in rows]  # raises ValueError naming the flag
    if a.steps < 2 or a.warmup < 1:
        ap.error("--steps must be >= 2 and --warmup >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except ValueError as e:
        print(f"bench_wire: {e}", file=sys.stderr)
        return 2
    if a.rank_spec:
        rank_main(json.loads(a.rank_spec))
        return 0
    from tests.netns_support import hosts, skip_reason

    reason = skip_reason() or (None if _has("tc") else "needs tc (iproute2) to shape the link")
    if reason:
        print(f"bench_wire: skipped: {reason}")
        return 0
    unwind_on_sigterm()  # the hosts torn down, whatever stops it
    t_start, conditions = time.time(), machine()  # the load average before the arms
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_CPP_LOG_LEVEL": "ERROR", "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip
    env.pop("PERDURE_PARENT_PID", None)
    keep = tempfile.mkdtemp(prefix="bench-wire-") if a.keep else None
    with _work_dir(keep) as d, hosts(3) as hs:
        atexit.register(hs.close)  # a second close is harmless: every delete is check=False
        tmp = Path(d)
        shaped = _shape(hs, a)
        counters = __import__("_wire_link").Counters.start(hs, RANKS, tmp, env)
        b = Bench(hs, counters, tmp, env, a, build_dataset(tmp / "data"))
        rates = _rates(b)
        print(f"raw TCP rate, Mbit/s: {rates}", flush=True)
        rows = _run_arms(b)
    params = next((r["params"] for r in rows if r.get("params")), None)
    rate = min(rates.values())
    floor = wire_floor_s(params, W, rate) if params and a.rate_mbit > 0 else None
    derive(rows, floor)
    data = {
        "name": "wire",
        "machine": conditions,
        "loadavg_at_end": list(os.getloadavg()),
        "command": " ".join(["bench_wire.py", *(sys.argv[1:] if argv is None else argv)]),
        "workers": W, "global_batch": GLOBAL_BATCH, "seq": SEQ, "model": a.model,
        "model_options": MODELS[a.model], "params": params,
        "steps": a.steps, "warmup": a.warmup, "rate_mbit": a.rate_mbit,
        "tbf": shaped, "raw_tcp_mbit": rates, "wire_floor_s": floor,
        "fp32_ring_mb": ring_bytes(params, W) / 1e6 if params else None,
        "rows": rows, "seconds": time.time() - t_start,
    }  # fmt: skip
    name = "wire" if a.rate_mbit > 0 else "wire_unshaped"
    print(table(rows))
    print(
        f"params {params}, raw {rates} Mbit/s, floor {_f(floor, 3)} s, "
        f"load {data['machine']['loadavg_at_start']} -> {data['loadavg_at_end']}"
    )
    print(f"wrote {write_result(name, data, a.out)}")
    return 0 if all("error" not in r or r["method"] == "fsdp2" for r in rows) else 1


def _work_dir(keep: str | None) -> Any:
    """A temporary directory, or ``keep`` (left in place, its path printed)."""
    import contextlib

    if keep is None:
        return tempfile.TemporaryDirectory(prefix="bench-wire-")
    print(f"work directory (kept): {keep}", flush=True)
    return contextlib.nullcontext(keep)


def _has(tool: str) -> bool:
    import shutil

    return shutil.which(tool) is not None


def _shape(hs: Any, a: argparse.Namespace) -> list[str]:
    from _wire_link import shape

    return shape(hs, RANKS, a.rate_mbit, a.burst_kb, a.tbf_latency_ms)


def _rates(b: Bench) -> dict[str, float]:
    from _wire_link import tcp_rate_mbit

    return {f"{s}->{t}": round(tcp_rate_mbit(b.hs, s, t, b.next_ports()), 1)
            for s, t in ((0, 1), (1, 0))}  # fmt: skip


def _run_arms(b: Bench) -> list[dict[str, Any]]:
    a = b.args
    rows = []
    for per_rank in a.slots_per_rank:
        micro = MICRO_OF_SLOTS[per_rank]
        arms = [("ddp", micro)] + ([] if a.no_fsdp2 else [("fsdp2", micro)])
        for method, m in arms:
            rows.append(_show(baseline_arm(b, method, m)))
        for row in a.rows:
            for k in a.shard_degrees:
                rows.append(_show(perdure_arm(b, row, per_rank, k)))
    return rows


def _show(row: dict[str, Any]) -> dict[str, Any]:
    s = row.get("step_s")
    brief = (f"step {s['median']:.3f} s, wire {_f(row.get('wire_mb_per_step'), 1)} MB, "
             f"rss {row.get('peak_rss_mb')}") if s else f"ERROR {row.get('error')}"  # fmt: skip
    print(f"{row['label']} k={row.get('k', '-')}: {brief}", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
