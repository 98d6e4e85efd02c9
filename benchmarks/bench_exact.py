"""The exact reduction (int32, int64) against gloo ``all_reduce`` and the chain, side by
side in one process group, same payload; plus its accuracy against a float64 sum.

    .venv/bin/python benchmarks/bench_exact.py            # 4..64 MB, W = 2, 3, 4
    .venv/bin/python benchmarks/bench_exact.py --quick    # 4..16 MB, W = 2, 3
    .venv/bin/python benchmarks/bench_exact.py --floors   # also the floors (below)

W spawned processes (one intra-op thread each) form one gloo group on loopback; each holds
one slot buffer of the payload size (random heavy-tailed values). Each repeat times, in a
rotating order: ``pg.allreduce`` of the float32 buffer (in place, input restored outside the
timing), ``ExactReducer.reduce`` with 64 and 32 bits (MAX of block exponents, conversion,
integer all_reduce, conversion back: everything the step pays), and ``chain_reduce``. A
time is the slowest rank's, from a barrier to the end. Ratios are per repeat, over
all_reduce. Accuracy: the median and max relative error per element of each method
against the float64 sum of the same slots (gathered on rank 0), next to the float32
all_reduce's own.

``--floors`` adds, in the same rotation: the integer all-reduce alone (int32 and int64
buffers of the payload's count, in the reducer's buckets, no conversion: what the exact
reduction cannot go below), the same with the cheapest conversion there could be (one
cast of the float32 buffer into the integers before, one cast back after: no exponents,
no scaling, no rounding; a lower bound on any fixed-point reduction's work, not a
reduction), and the exact reduction through the torch ops (the fallback, as it was
before the fused kernels).

Every method's CPU time is recorded too: the CPU seconds of all of a rank's threads
(``time.process_time``, gloo's included) over the timed call, summed over the ranks. On a
machine with fewer cores than ranks, ``cpu / cores`` bounds a method's wall time from
below whatever overlaps, so ``cpu_floor`` (a method's summed CPU over the cores, divided by
the same repeat's all_reduce wall time) is the least ratio this machine allows that
method, and ``busy`` (the all_reduce's summed CPU over cores x wall) says how much of the
machine the float32 all_reduce alone keeps busy.

Results: ``benchmarks/results/exact.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import InlineComm, fmt, free_port, gloo_group, machine, ratios, stats, write_result

MB = 1 << 20
METHODS = ("all_reduce", "exact64", "exact32", "chain")
FLOORS = (
    "int32_all_reduce",
    "int64_all_reduce",
    "int32_casts",
    "int64_casts",
    "exact32_torch",
    "exact64_torch",
)
CARRIED = ("carried64",)
"""``--carried``: the exact reduction with carried exponents (``comm/carried.py``) in its
steady state (the prediction made from a measuring pass outside the timing, so every
timed repeat is accepted): the slot added to the accumulator, the step's true exponents
all-reduced alongside the integer sum, the sum converted back."""


def _slot(n: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))


def _worker(rank, size, port, sizes_mb, repeats, q, methods=METHODS):  # pragma: no cover
    import torch

    torch.set_num_threads(1)
    from datetime import timedelta

    from perdure.runtime.comm.carried import CarriedReducer, predict
    from perdure.runtime.comm.chain import chain_reduce
    from perdure.runtime.comm.exact import CHUNK, ExactReducer

    _store, pg = gloo_group(rank, size, port, prefix="exact")
    timeout = timedelta(seconds=600)
    results = []
    for mb in sizes_mb:
        n = int(mb * MB) // 4
        src = _slot(n, rank)
        buf, partial, out = src.clone(), torch.zeros(n), torch.zeros(n)
        reducers = {b: ExactReducer(rank, size, slots=size, bits=b, block=256) for b in (64, 32)}
        torch_ops = {
            b: ExactReducer(rank, size, slots=size, bits=b, block=256, fused=False)
            for b in (64, 32)
        }
        ints = {b: torch.zeros(n, dtype=getattr(torch, f"int{b}")) for b in (64, 32)}
        outputs = {}
        carried = CarriedReducer(rank, size, slots=size, block=256)
        now = InlineComm(pg)
        carried.open(buf, None)
        buf.copy_(src)
        carried.add(buf)
        _, maxima = carried.finish(now, buf, timeout=timeout).result()
        predicted = predict(maxima)

        def run(  # the loop's values, bound as defaults (B023)
            name,
            buf=buf,
            src=src,
            partial=partial,
            out=out,
            reducers=reducers,
            outputs=outputs,
            torch_ops=torch_ops,
            ints=ints,
            n=n,
            carried=carried,
            predicted=predicted,
            now=now,
        ):
            buf.copy_(src)
            pg.barrier().wait()
            c0, t0 = time.process_time(), time.perf_counter()
            if name == "all_reduce":
                pg.allreduce([buf]).wait()
                res = buf
            elif name == "chain":
                chain_reduce(pg, rank, size, [buf], partial, out, timeout=timeout)
                res = out
            elif name.endswith(("_all_reduce", "_casts")):  # a floor: no result to check
                x, casts = ints[int(name[3:5])], name.endswith("_casts")
                if casts:
                    x.copy_(buf)
                for w in [pg.allreduce([x[lo : lo + CHUNK]]) for lo in range(0, n, CHUNK)]:
                    w.wait()
                if casts:
                    out.copy_(x)
                return time.perf_counter() - t0, time.process_time() - c0
            elif name == "carried64":
                carried.open(buf, predicted)
                res, _ = carried.finish(now, buf, last=buf, timeout=timeout).result()
            elif name.endswith("_torch"):
                res = torch_ops[int(name[5:7])].reduce(pg, [buf], timeout)
            else:
                res = reducers[int(name[-2:])].reduce(pg, [buf], timeout)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            outputs[name] = res.clone()
            return dt, cpu

        for name in methods:
            run(name)  # warm-up
        times = {m: [] for m in methods}
        cpus = {m: [] for m in methods}
        for r in range(repeats):
            k = r % len(methods)
            for name in methods[k:] + methods[:k]:
                dt, cpu = run(name)
                times[name].append(dt)
                cpus[name].append(cpu)
        t = torch.tensor([times[m] for m in methods], dtype=torch.float64)
        pg.allreduce([t], opts=_max_opts()).wait()
        c = torch.tensor([cpus[m] for m in methods], dtype=torch.float64)
        pg.allreduce([c]).wait()  # the machine's CPU seconds per call: every rank's, summed
        err = _errors(pg, rank, size, src, outputs)
        if rank == 0:
            results.append(
                {
                    "mb": mb,
                    "times": {m: t[i].tolist() for i, m in enumerate(methods)},
                    "cpu": {m: c[i].tolist() for i, m in enumerate(methods)},
                    **err,
                }
            )
    pg.barrier().wait()
    if rank == 0:
        q.put(results)


def _errors(pg, rank, size, src, outputs):
    """Relative error per element against the float64 sum of every rank's slot."""

    exact = src.double()
    pg.allreduce([exact]).wait()  # float64 sum: ~29 more bits than any method here
    denom = exact.abs().clamp_min(1e-30)
    out = {}
    for name, res in outputs.items():
        rel = (res.double() - exact).abs() / denom
        out[name] = {"median": float(rel.median()), "max": float(rel.max())}
    return {"relative_error": out} if rank == 0 else {}


def _max_opts():
    import torch.distributed as dist

    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    return o


def run_world(size, sizes_mb, repeats, methods=METHODS):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    args = (size, port, sizes_mb, repeats, q, methods)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes-mb", type=float, nargs="*")
    ap.add_argument("--worlds", type=int, nargs="*")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--floors", action="store_true", help="also the floors (module doc)")
    ap.add_argument("--carried", action="store_true", help="also carried exponents (CARRIED)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    sizes = a.sizes_mb or ([4, 16] if a.quick else [4, 16, 64])
    worlds = a.worlds or ([2, 3] if a.quick else [2, 3, 4])
    repeats = a.repeats or (3 if a.quick else 5)
    methods = METHODS + (FLOORS if a.floors else ()) + (CARRIED if a.carried else ())
    rows = []
    host = machine()
    cores = host["affinity_cores"] or host["cores"] or 1
    t_start = time.perf_counter()
    for w in worlds:
        for res in run_world(w, sizes, repeats, methods):
            base = res["times"]["all_reduce"]
            row = {"workers": w, "mb": res["mb"], "relative_error": res["relative_error"]}
            row["busy"] = ratios([x / cores for x in res["cpu"]["all_reduce"]], base)
            for m in methods:
                row[f"{m}_s"] = stats(res["times"][m])
                row[f"{m}_cpu_s"] = stats(res["cpu"][m])
                row[f"cpu_floor_{m}"] = ratios([x / cores for x in res["cpu"][m]], base)
                if m != "all_reduce":
                    row[f"ratio_{m}_over_all_reduce"] = ratios(res["times"][m], base)
            rows.append(row)
            print(
                f"W={w} {res['mb']:>5g} MB"
                f"  all_reduce {row['all_reduce_s']['median'] * 1e3:7.1f} ms"
                + "".join(
                    f"  {m} {fmt(row[f'ratio_{m}_over_all_reduce'], 2)}"
                    f" (cpu floor {row[f'cpu_floor_{m}']['median']:.2f})"
                    for m in methods[1:]
                )
                + f"  busy {row['busy']['median']:.2f}",
                flush=True,
            )
    data = {
        "name": "exact",
        "machine": host,
        "quick": a.quick,
        "floors": a.floors,
        "carried": a.carried,
        "repeats": repeats,
        "threads_per_process": 1,
        "cores": cores,
        "goal": "exact int32 <= 1.10x all_reduce at W = 2-4, >= 16 MB; int64 <= 2.1x",
        "rows": rows,
        "seconds": time.perf_counter() - t_start,
    }
    print(f"wrote {write_result('exact', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
