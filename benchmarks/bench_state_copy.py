"""State copy rate on loopback: the swarm copy (``runtime/comm/swarm.py``) from 1, 2 and 3
holders, the old one-source broadcast (``comm/transfer.py``: pack, broadcast, unpack), and
a plain socket copy of the same bytes, side by side in one script.

    flock /tmp/perdure-bench.lock .venv/bin/python benchmarks/bench_state_copy.py
    .venv/bin/python benchmarks/bench_state_copy.py --mb 64 --repeat 1   # quick

The state: a model of ``--mb``/3 MB of float32 parameters in 8 tensors with AdamW's state
(exp_avg, exp_avg_sq, a step per parameter): ``--mb`` MB in all, the shape of a real
replica's export. Each arm spawns its processes (one per holder, one joiner; one
intra-op thread each) over a gloo group on 127.0.0.1 and times, on the joiner, the
copy call alone (offers, plan, ranges, verdict; process start and group set-up excluded).
Per holder: the peak extra RSS during the copy (``/proc/self/clear_refs`` resets VmHWM
before it; VmHWM - VmRSS before, read after), which the issue bounds by 64 MB. The
baseline socket copy sends the same bytes from a tensor over one TCP connection
(``sendall`` of a memoryview, ``recv_into`` the receiver's tensor): the loopback's rate
for one stream on this machine. The machine has 2 cores shared with other sessions: a
holder, the joiner and the kernel's loopback share them, so more holders add CPU
contention, not link capacity; the load average is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, REPO, free_port, machine, write_result

T = timedelta(seconds=300)
TENSORS = 8


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> None:
    with contextlib.suppress(OSError):  # the peak then counts from process start
        Path("/proc/self/clear_refs").write_text("5")


def _state(mb: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import torch

    n = int(mb * 2**20 / 4 / 3 / TENSORS)
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(TENSORS)}
    state = {
        i: {
            "step": torch.tensor(7.0),
            "exp_avg": torch.randn(n, generator=g),
            "exp_avg_sq": torch.rand(n, generator=g),
        }
        for i in range(TENSORS)
    }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "params": list(range(TENSORS))}]
    optim = {"state": state, "param_groups": groups}
    extra = {"next_step": 7, "data": {}, "decisions": [], "held": -1}
    return model, optim, extra


def _rank(arm: str, rank: int, world: int, port: int, mb: float, q: Any) -> None:
    q.put(rank_main({"arm": arm, "rank": rank, "world": world, "port": port, "mb": mb}))


def rank_main(spec: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - a rank process
    """One rank of an arm: ``spec`` names the arm, rank, world, store port, state size and,
    on the netns hosts, the store's address (``master``) and this rank's (``bind``)."""
    import torch

    arm, rank, world, port, mb = (spec[k] for k in ("arm", "rank", "world", "port", "mb"))
    master, bind = spec.get("master", "127.0.0.1"), spec.get("bind", "127.0.0.1")

    torch.set_num_threads(1)
    from perdure.runtime.comm.group import Comm
    from perdure.runtime.comm.swarm import CopyJob, SwarmCopy
    from perdure.runtime.comm.transfer import broadcast_state, pack, unpack

    joiner = world - 1
    model, optim, extra = _state(mb)
    layout = {n: (tuple(t.shape), t.dtype) for n, t in model.items()}
    store = torch.distributed.TCPStore(master, port, world, rank == 0, T)
    comm = Comm(store, "copy/", rank, world, T, lambda: False, bind=bind)
    comm.any_rank(False)  # every pair connected before the clock starts
    if rank == joiner:
        mine = {n: torch.empty_like(t) for n, t in model.items()}

        def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if key.startswith("model/"):
                return mine[key[len("model/") :]]
            return torch.empty(shape, dtype=dtype)

    rss0 = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    if arm == "swarm":
        job = CopyJob(
            receivers=(joiner,),
            source=0,
            shard_degree=1,
            layout=layout,
            offer=None if rank == joiner else (model, optim, extra),
            target=target if rank == joiner else None,
            timeout=T,
        )
        got = SwarmCopy().copy(comm, job)
        ok = got is None or all(torch.equal(got.model[n], model[n]) for n in model)
    else:  # the old path: pack on the source, broadcast, unpack on the joiner
        payload = pack(model, optim, extra) if rank == 0 else None
        head, blob = broadcast_state(comm, 0, payload, T)
        ok = True
        if rank == joiner:
            m, _, _ = unpack(head, blob)
            ok = all(torch.equal(m[n], model[n]) for n in model)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - rss0
    comm.any_rank(False)
    comm.close()
    return {"rank": rank, "seconds": seconds, "peak_extra_bytes": peak, "ok": ok}


def _arm(arm: str, holders: int, mb: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, port = holders + 1, free_port()
    procs = [ctx.Process(target=_rank, args=(arm, r, world, port, mb, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return _row(arm, holders, mb, rows)


def _row(arm: str, holders: int, mb: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    joiner = rows[-1]
    nbytes = mb * 2**20
    return {
        "arm": arm,
        "holders": holders,
        "seconds": round(joiner["seconds"], 4),
        "gbit_s": round(nbytes * 8 / joiner["seconds"] / 1e9, 3),
        "source_peak_extra_mb": round(max(r["peak_extra_bytes"] for r in rows[:-1]) / 2**20, 1),
        "joiner_peak_extra_mb": round(joiner["peak_extra_bytes"] / 2**20, 1),
        "bitwise": all(r["ok"] for r in rows),
    }


def _socket_side(send: bool, port: int, mb: float, q: Any) -> None:
    import torch

    from perdure.checkpoint.tensors import byte_view

    n = int(mb * 2**20)
    u8 = torch.uint8
    buf = torch.randint(0, 255, (n,), dtype=u8) if send else torch.empty(n, dtype=u8)
    view = byte_view(buf)
    if send:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
            s.sendall(view)
        return
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        q.put("listening")
        conn, _ = srv.accept()
        with conn:
            t0, got = time.perf_counter(), 0
            while got < n:
                k = conn.recv_into(view[got:], n - got)
                if not k:
                    break
                got += k
            q.put(time.perf_counter() - t0)


def _socket(mb: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    recv = ctx.Process(target=_socket_side, args=(False, port, mb, q))
    recv.start()
    assert q.get(timeout=120) == "listening"
    send = ctx.Process(target=_socket_side, args=(True, port, mb, q))
    send.start()
    seconds = q.get(timeout=600)
    for p in (send, recv):
        p.join(60)
    return {
        "arm": "socket",
        "holders": 1,
        "seconds": round(seconds, 4),
        "gbit_s": round(mb * 2**20 * 8 / seconds / 1e9, 3),
    }


# -- the shaped link (network namespaces, tbf) ------------------------------------------


def netns_rows(a: argparse.Namespace) -> dict[str, Any] | None:
    """Holders on hosts 0..2 (each veth shaped to ``--holder-mbit``), the joiner on host 3
    (``--joiner-mbit``): one holder's path is held to the holder's rate, and the joiner's
    link fills only with several. None (and why, printed) where namespaces cannot be made."""
    from _wire_link import shape, tcp_rate_mbit

    from tests.netns_support import hosts, skip_reason

    reason = skip_reason()
    if reason is not None:
        print(f"netns: skipped: {reason}", flush=True)
        return None
    with hosts(4) as hs:
        cmds = shape(hs, [0, 1, 2], a.holder_mbit, a.burst_kb, a.tbf_latency_ms)
        cmds += shape(hs, [3], a.joiner_mbit, a.burst_kb, a.tbf_latency_ms)
        link = tcp_rate_mbit(hs, 0, 3, free_port())
        rows = []
        arms = [("broadcast", 1), ("swarm", 1), ("swarm", 2), ("swarm", 3)]
        for arm, holders in arms:
            row = _netns_arm(hs, arm, holders, a.netns_mb)
            row["vs_link"] = round(row["gbit_s"] * 1000 / link, 3)
            rows.append(row)
            print(row, flush=True)
        return {"tc": cmds, "raw_tcp_mbit_0_to_3": round(link, 1), "rows": rows}


def _netns_arm(hs: Any, arm: str, holders: int, mb: float) -> dict[str, Any]:
    world, port = holders + 1, free_port()
    on = [*range(holders), 3]  # rank -> host
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    logs = []
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rank, host in enumerate(on):
            spec = {"arm": arm, "rank": rank, "world": world, "port": port, "mb": mb,
                    "master": hs[on[0]].address, "bind": hs[host].address}  # fmt: skip
            log = Path(tmp) / f"rank{rank}.log"
            logs.append(log)
            argv = [PY, str(Path(__file__).resolve()), "--rank-spec", json.dumps(spec)]
            procs.append(hs.start(host, argv, env=env, cwd=REPO, log=log))
        for p in procs:
            p.wait(timeout=600)
        rows = []
        for log in logs:
            lines = [x for x in log.read_text().splitlines() if x.startswith("{")]
            if not lines:
                raise RuntimeError(f"{arm} x{holders}: a rank wrote no result:\n{log.read_text()}")
            rows.append(json.loads(lines[-1]))
    return _row(arm, holders, mb, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=384, help="state size, MiB (model + AdamW)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per arm (the median is kept)")
    ap.add_argument("--out", default=None, help="result JSON (default results/state_copy.json)")
    ap.add_argument("--no-loopback", action="store_true", help="the shaped link's rows only")
    ap.add_argument("--netns", action="store_true", help="also the shaped link (needs root)")
    ap.add_argument("--netns-mb", type=float, default=24, help="state size on the shaped link")
    ap.add_argument("--holder-mbit", type=float, default=100, help="tbf rate of a holder's host")
    ap.add_argument("--joiner-mbit", type=float, default=300, help="tbf rate of the joiner's")
    ap.add_argument("--burst-kb", type=int, default=256, help="tbf burst, KiB")
    ap.add_argument("--tbf-latency-ms", type=int, default=50, help="tbf latency (queue), ms")
    ap.add_argument("--rank-spec", default=None, help=argparse.SUPPRESS)  # a netns rank
    a = ap.parse_args(argv)
    if a.rank_spec is not None:
        print(json.dumps(rank_main(json.loads(a.rank_spec))), flush=True)
        return 0
    info = machine()
    result: dict[str, Any] = {"machine": info, "mb": a.mb}
    if not a.no_loopback:
        result["rows"] = _loopback(a)
    if a.netns:
        result["netns"] = {
            "mb": a.netns_mb,
            "holder_mbit": a.holder_mbit,
            "joiner_mbit": a.joiner_mbit,
            **(netns_rows(a) or {"skipped": True}),
        }
    info["loadavg_at_end"] = list(os.getloadavg())
    write_result("state_copy", result, a.out)
    return 0


def _loopback(a: argparse.Namespace) -> list[dict[str, Any]]:
    arms = [("socket", 1), ("broadcast", 1), ("swarm", 1), ("swarm", 2), ("swarm", 3)]
    rows = []
    for arm, holders in arms:
        runs = [
            _socket(a.mb) if arm == "socket" else _arm(arm, holders, a.mb) for _ in range(a.repeat)
        ]
        best = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
        best = {**best, "runs_gbit_s": [r["gbit_s"] for r in runs]}
        rows.append(best)
        print(best, flush=True)
    sock = rows[0]["gbit_s"]
    for r in rows:
        r["vs_socket"] = round(r["gbit_s"] / sock, 3)
    print(f"median of {a.repeat}; socket {sock} Gbit/s", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
