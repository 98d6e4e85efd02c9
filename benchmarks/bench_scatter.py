"""The exact reduction in replica groups: reduce-scattered (``train.shard_reduce =
"scatter"``, ``comm/scatter.py``) against the whole all-reduce every rank takes part in
(``"whole"``), beside gloo's float32 ``all_reduce`` of the same payload, side by side in
the same processes.

For each (W, k) and payload of P float32 values: W spawned ranks over loopback, each with
``--slots`` slot buffers of heavy-tailed values, k ranks per replica group (so W/k groups);
each repeat times the three back to back on every rank (the slowest rank's time counts)
and checks that the scatter's own range and tail equal the whole reduction's bits.

Also the bytes a rank sends for the gradient part under a ring model (the reduce-scatter
(k - 1)/k P inside the group plus the all-reduce 2 (W/k - 1)/(W/k) P/k across groups,
against the flat all-reduce's 2 (W - 1)/W P), in accumulator words.

Limits: loopback on a 2-core machine, where every rank shares the cores and memory
bandwidth; on such a machine bytes on the wire cost what a memory copy costs, so the ratio
of times says little of a network. The peak scratch per rank is not measured here: the
scatter keeps the whole accumulator and float buffer (P each) plus a range-sized receive
buffer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, free_port, machine, ratios, stats, write_result

from perdure.runtime.comm.exact import ExactReducer
from perdure.runtime.comm.scatter import Scatter
from perdure.runtime.shard_plan import contiguous_owners, shard_ranges

T = timedelta(seconds=300)
TAIL = 34  # a slot buffer's tail: flags and losses of 16 slots, two buffer moves


def _ranges(n: int, k: int) -> tuple[tuple[int, int], ...]:
    """Parameters of uneven sizes (a model's: 1M, 4M, 256 ...) cut into k runs."""
    sizes, left, i = [], n, 0
    while left > 0:
        s = min(left, [1 << 20, 4 << 20, 256, 3 << 18][i % 4])
        sizes.append(s)
        left, i = left - s, i + 1
    owner = contiguous_owners([[j] for j in range(len(sizes))], sizes, k)
    assert owner is not None
    return tuple(shard_ranges(owner, sizes, k))


def _rank(rank: int, world: int, port: int, args: Any, k: int, n: int, q: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("all/", store), rank, world, T)
    g, j = rank // k, rank % k
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"group{g}/", store), j, k, T)
    cross = None
    if world > k:
        cross = dist.ProcessGroupGloo(dist.PrefixStore(f"cross{j}/", store), g, world // k, T)
    size = n + TAIL
    sc = Scatter(group, cross, _ranges(n, k), j, n, size, args.in_group)
    slots = args.slots * world
    whole = ExactReducer(rank, world, slots=slots, bits=args.bits, block=256)
    scat = ExactReducer(rank, world, slots=slots, bits=args.bits, block=256, scatter=sc)
    gen = torch.Generator().manual_seed(rank)
    bufs = [
        torch.randn(size, generator=gen) * torch.exp(3 * torch.randn(size, generator=gen))
        for _ in range(args.slots)
    ]
    plain = torch.randn(n, generator=gen)
    times: dict[str, list[float]] = {"whole": [], "scatter": [], "all_reduce": []}
    equal = True
    for rep in range(args.repeats + 1):
        for name, fn in (
            ("whole", lambda: whole.reduce(pg, bufs, T)),
            ("scatter", lambda: scat.reduce(pg, bufs, T)),
            ("all_reduce", lambda: pg.allreduce([plain]).wait(T)),
        ):
            pg.barrier().wait(T)
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if rep:  # the first is a warm-up
                times[name].append(dt)
            if name == "whole":
                want = out.clone()
            if name == "scatter":
                equal = equal and all(torch.equal(out[a:b], want[a:b]) for a, b in sc.spans())
    q.put((rank, times, equal))


def _one(args: Any, world: int, k: int, n: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, k, n, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=900) for _ in range(world)]
    for p in procs:
        p.join(60)
    slowest = {
        name: [max(t[name][i] for _, t, _ in got) for i in range(args.repeats)]
        for name in ("whole", "scatter", "all_reduce")
    }
    groups = world // k
    words = {
        "flat_all_reduce": 2 * (world - 1) / world,
        "scatter": (k - 1) / k + 2 * (groups - 1) / groups / k,
    }
    return {
        "W": world,
        "k": k,
        "mb": n * 4 / 1e6,
        "seconds": {name: stats(ts) for name, ts in slowest.items()},
        "scatter_over_whole": ratios(slowest["scatter"], slowest["whole"]),
        "scatter_over_all_reduce": ratios(slowest["scatter"], slowest["all_reduce"]),
        "whole_over_all_reduce": ratios(slowest["whole"], slowest["all_reduce"]),
        "words_per_value_sent": words,
        "bitwise_equal": all(eq for _, _, eq in got),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="2x2,4x2,4x4", help="W x k pairs, comma-separated")
    ap.add_argument("--mb", default="16,64", help="payload sizes in MB of float32")
    ap.add_argument("--slots", type=int, default=2, help="slot buffers per rank")
    ap.add_argument("--bits", type=int, default=64, choices=(32, 64))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--in-group",
        default="all_reduce",
        choices=("all_reduce", "reduce_scatter"),
        help="the first tier's collective (Scatter.in_group; the runtime's on gloo: all_reduce)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="W=2, k=2, 4 MB, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.layouts, args.mb, args.repeats = "2x2", "4", 2
    rows = []
    for layout in args.layouts.split(","):
        world, k = (int(x) for x in layout.split("x"))
        for mb in args.mb.split(","):
            row = _one(args, world, k, int(float(mb) * 1e6 / 4))
            rows.append(row)
            print(
                f"W={world} k={k} {row['mb']:.0f} MB: scatter/whole "
                f"{fmt(row['scatter_over_whole'], 2)}, scatter/all_reduce "
                f"{fmt(row['scatter_over_all_reduce'], 2)}, whole/all_reduce "
                f"{fmt(row['whole_over_all_reduce'], 2)}, bitwise {row['bitwise_equal']}",
                flush=True,
            )
    write_result(
        "scatter",
        {
            "machine": machine(),
            "bits": args.bits,
            "slots": args.slots,
            "in_group": args.in_group,
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
