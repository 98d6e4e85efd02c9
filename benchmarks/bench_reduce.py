"""The deterministic chain reduction against gloo ``all_reduce``, side by side, same payload.

    .venv/bin/python benchmarks/bench_reduce.py            # 1..256 MB, W = 2, 3, 4
    .venv/bin/python benchmarks/bench_reduce.py --quick    # 1..16 MB, W = 2, 3

W spawned processes (one intra-op thread each, as perdure's workers run) form one gloo group
on loopback. For each payload size, each repeat times, in a rotating order so that neither
side always goes first: ``pg.allreduce`` (SUM) of a float32 buffer, and
``perdure.runtime.comm.chain.chain_reduce`` of the same buffer (one slot per rank) with the
default ``CHUNK_ELEMS`` and with the other chunk sizes of ``--chunks``. A time is the slowest
rank's, from a barrier to the end of the operation on that rank. Ratios are per repeat
(chain / all_reduce), min / median / max.

Results: ``benchmarks/results/reduce.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, free_port, gloo_group, machine, ratios, stats, write_result

MB = 1 << 20


def _worker(rank, size, port, sizes_mb, chunks, repeats, q):  # pragma: no cover - subprocess
    import torch

    torch.set_num_threads(1)
    from datetime import timedelta

    from perdure.runtime.comm.chain import chain_reduce

    _store, pg = gloo_group(rank, size, port, prefix="reduce")
    timeout = timedelta(seconds=300)
    results = []
    g = torch.Generator().manual_seed(rank)
    for mb in sizes_mb:
        n = int(mb * MB) // 4
        src = torch.rand(n, generator=g)
        ar = src.clone()
        partial, out = torch.empty(n), torch.empty(n)
        partial.zero_()  # touch the pages: timing the op, not page faults
        out.zero_()
        ops = [("all_reduce", None)] + [(f"chain_{c}", c) for c in chunks]

        def run(op, ar=ar, src=src, partial=partial, out=out):
            _, c = op
            if c is None:
                ar.copy_(src)  # all_reduce is in place: restore the input (copy timed outside)
                pg.barrier().wait()
                t0 = time.perf_counter()
                pg.allreduce([ar]).wait()
                return time.perf_counter() - t0
            pg.barrier().wait()
            t0 = time.perf_counter()
            chain_reduce(pg, rank, size, [src], partial, out, timeout=timeout, chunk=c)
            return time.perf_counter() - t0

        for op in ops:  # warm-up: connections, allocator, caches
            run(op)
        times = {name: [] for name, _ in ops}
        for r in range(repeats):
            k = r % len(ops)
            for op in ops[k:] + ops[:k]:
                times[op[0]].append(run(op))
        # slowest rank per repeat
        names = [name for name, _ in ops]
        t = torch.tensor([times[nm] for nm in names], dtype=torch.float64)
        pg.allreduce([t], opts=_max_opts()).wait()
        if rank == 0:
            results.append({"mb": mb, "times": {nm: t[i].tolist() for i, nm in enumerate(names)}})
    pg.barrier().wait()
    if rank == 0:
        q.put(results)


def _max_opts():
    import torch.distributed as dist

    o = dist.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.MAX
    return o


def run_world(size, sizes_mb, chunks, repeats):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, size, port, sizes_mb, chunks, repeats, q))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


def main(argv=None) -> int:
    from perdure.runtime.comm.chain import CHUNK_ELEMS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes-mb", type=float, nargs="*")
    ap.add_argument("--worlds", type=int, nargs="*")
    ap.add_argument("--chunks", type=int, nargs="*", help="chunk sizes in elements")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.quick:
        sizes = a.sizes_mb or [1, 4, 16]
        worlds = a.worlds or [2, 3]
        repeats = a.repeats or 3
        chunks = a.chunks or [CHUNK_ELEMS, 1 << 20]
    else:
        sizes = a.sizes_mb or [1, 4, 16, 64, 256]
        worlds = a.worlds or [2, 3, 4]
        repeats = a.repeats or 5
        chunks = a.chunks or [CHUNK_ELEMS, 1 << 16, 1 << 20, 1 << 22]
    chunks = [CHUNK_ELEMS] + [c for c in chunks if c != CHUNK_ELEMS]
    default = f"chain_{CHUNK_ELEMS}"
    rows = []
    t_start = time.perf_counter()
    for w in worlds:
        for res in run_world(w, sizes, chunks, repeats):
            base = res["times"]["all_reduce"]
            row = {
                "workers": w,
                "mb": res["mb"],
                "all_reduce_s": stats(base),
                "chain_s": stats(res["times"][default]),
                "ratio_chain_over_all_reduce": ratios(res["times"][default], base),
                "all_reduce_gb_s": res["mb"] * MB / 1e9 / min(base),
                "chunks": {
                    k.split("_", 1)[1]: {
                        "s": stats(v),
                        "ratio_over_all_reduce": ratios(v, base),
                    }
                    for k, v in res["times"].items()
                    if k.startswith("chain_")
                },
            }
            best = min(row["chunks"], key=lambda c: row["chunks"][c]["s"]["median"])
            row["best_chunk_elems"] = int(best)
            row["ratio_best_chunk_over_all_reduce"] = row["chunks"][best]["ratio_over_all_reduce"]
            rows.append(row)
            print(
                f"W={w} {res['mb']:>6g} MB"
                f"  all_reduce {row['all_reduce_s']['median'] * 1e3:8.2f} ms"
                f"  chain {row['chain_s']['median'] * 1e3:8.2f} ms"
                f"  ratio {fmt(row['ratio_chain_over_all_reduce'], 2)}"
                f"  best chunk {best} ({fmt(row['ratio_best_chunk_over_all_reduce'], 2)})",
                flush=True,
            )
    # which chunk is best overall: geometric mean of median ratios
    import math

    score = {}
    for c in map(str, chunks):
        vals = [r["chunks"][c]["ratio_over_all_reduce"]["median"] for r in rows]
        score[c] = math.exp(sum(math.log(v) for v in vals) / len(vals))
    medians = [r["ratio_chain_over_all_reduce"]["median"] for r in rows]
    data = {
        "name": "reduce",
        "machine": machine(),
        "quick": a.quick,
        "threads_per_process": 1,
        "repeats": repeats,
        "default_chunk_elems": CHUNK_ELEMS,
        "goal": "chain_reduce <= 1.2x all_reduce",
        "rows": rows,
        "chunk_geomean_ratio": score,
        "best_chunk_elems_overall": int(min(score, key=score.get)),
        "summary": {
            "ratio_default_chunk": stats(medians),
            "rows_meeting_goal": sum(m <= 1.2 for m in medians),
            "rows": len(medians),
            "goal_met": all(m <= 1.2 for m in medians),
        },
        "seconds": time.perf_counter() - t_start,
    }
    p = write_result("reduce", data, a.out)
    print(f"chunk geomean ratios: { {k: round(v, 3) for k, v in score.items()} }")
    print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
