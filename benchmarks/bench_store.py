"""Group formation through the run's authenticated store against a plain TCPStore.

W processes form ``--groups`` gloo groups in turn, each under a fresh prefix (what every
membership epoch does), once through torch's ``TCPStore`` (unauthenticated; its server
in the first process) and once through perdure's ``AuthStore`` (HMAC admission, values in
a ``HashStore`` behind ``StoreServer``), alternating per repeat. Reports the seconds to
form one group (max over ranks) and the ratio AuthStore / TCPStore, paired per repeat.

    .venv/bin/python benchmarks/bench_store.py [--workers 4] [--groups 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from datetime import timedelta

from _common import free_port, machine, ratios, stats, write_result

TOKEN = "bench-token"


def _store(kind: str, rank: int, port: int, world: int):
    import torch.distributed as dist

    from perdure.runtime.control.auth_store import AuthStore

    if kind == "tcp":
        return dist.TCPStore(
            "127.0.0.1", port, world, rank == 0, timedelta(seconds=60), wait_for_workers=False
        )
    return AuthStore("127.0.0.1", port, TOKEN, timedelta(seconds=60))


def _member(kind: str, rank: int, port: int, world: int, groups: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    store = _store(kind, rank, port, world)
    times = []
    for g in range(groups):
        sub = dist.PrefixStore(f"pg/{kind}/{g}/", store)
        t0 = time.perf_counter()
        pg = dist.ProcessGroupGloo(sub, rank, world, timedelta(seconds=60))
        pg.allreduce([torch.zeros(1)]).wait()  # every member is connected
        times.append(time.perf_counter() - t0)
    out.put((rank, times))
    time.sleep(0.5)  # rank 0 hosts the TCPStore: outlive the others' last calls


def _round(kind: str, world: int, groups: int) -> list[float]:
    from perdure.runtime.control.store import StoreServer

    server = StoreServer("127.0.0.1", 0, TOKEN) if kind == "auth" else None
    port = server.port if server else free_port()
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_member, args=(kind, r, port, world, groups, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    if server:
        server.close()
    return [max(per_rank[r][g] for r in range(world)) for g in range(groups)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.quick:
        a.groups, a.repeats = 5, 2
    tcp, auth = [], []
    for r in range(a.repeats):
        order = ("tcp", "auth") if r % 2 == 0 else ("auth", "tcp")
        got = {k: stats(_round(k, a.workers, a.groups)) for k in order}
        tcp.append(got["tcp"]["median"])
        auth.append(got["auth"]["median"])
        print(f"repeat {r}: tcp {tcp[-1] * 1e3:.1f} ms, auth {auth[-1] * 1e3:.1f} ms", flush=True)
    result = {
        "machine": machine(),
        "workers": a.workers,
        "groups_per_repeat": a.groups,
        "tcpstore_group_s": stats(tcp),
        "authstore_group_s": stats(auth),
        "ratio_authstore_over_tcpstore": ratios(auth, tcp),
        "command": f"benchmarks/bench_store.py --workers {a.workers} --groups {a.groups} "
        f"--repeats {a.repeats}",
    }
    print(result["ratio_authstore_over_tcpstore"])
    write_result("store", result, a.out)


if __name__ == "__main__":
    main()
