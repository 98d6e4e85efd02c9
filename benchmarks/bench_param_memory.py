"""Parameters sharded at rest and gathered while a slot runs (``runtime/replica/param_gather.py``):
peak parameter + optimizer bytes per rank, and slot time, against the whole replica.

    .venv/bin/python benchmarks/bench_param_memory.py                 # k = 2, 4
    .venv/bin/python benchmarks/bench_param_memory.py --layers 10 --d-model 128

Model: the tiny_lm of ``bench_recovery`` (d_model 128, 10 layers, ~2M parameters;
``--d-model``/``--layers`` to change). For each k, k spawned processes form one gloo group
on loopback (one thread each); each owns the parameters the runtime gives its shard
(``shard_plan.unit_owners`` over ``param_gather.units``: whole gather units, one broadcast
each) and holds AdamW state for those only (measured after one real ``step``: the bytes
of every state tensor). Peak parameter bytes are the largest sum of resident parameter
storages during ``--slots`` slots (``ParamGather.peak_bytes``, counted at every gather and
free, so it is the tensors' own bytes, not the process's resident set). The baseline is
k = 1 without gathering, in the same run: the whole replica and its whole AdamW state.
Slot time: the median over the slots after the first, the whole replica's beside it (the
k ranks share this machine's cores, so the time ratio is an upper bound of the gathers'
cost on hardware with a core or a device per rank). Every rank's gradients are checked
bitwise against the whole replica's.

Results: ``benchmarks/results/param_memory.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import free_port, gloo_group, machine, write_result


def _model(d_model: int, layers: int) -> Any:
    import torch

    from examples.tiny_lm.task import TinyLM

    torch.manual_seed(0)
    return TinyLM(d_model=d_model, n_layers=layers, n_heads=4, max_len=64, dropout=0.1)


def _slots(model: Any, slots: int, gather: Any) -> tuple[list[float], list[bytes]]:
    import contextlib

    import torch

    from examples.tiny_lm.task import loss_fn

    times, digests = [], []
    for s in range(slots):
        g = torch.Generator().manual_seed(s)
        batch = {"tokens": torch.randint(0, 256, (4, 65), generator=g), "weight": torch.ones(4)}
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1000 + s)
        t0 = time.perf_counter()
        with gather.active(model) if gather is not None else contextlib.nullcontext():
            loss_fn(model, batch).backward()
        times.append(time.perf_counter() - t0)
        digests.append(b"".join(p.grad.numpy().tobytes() for p in model.parameters()))
    return times, digests


def _opt_bytes(params: list[Any]) -> int:
    import torch

    if not params:
        return 0
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    return sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )


def _rank(rank: int, k: int, port: int, args: dict, q: Any) -> None:  # pragma: no cover
    import torch

    from perdure.runtime.replica.param_gather import ParamGather, unit_budget, units
    from perdure.runtime.shard_plan import unit_owners

    torch.set_num_threads(1)
    _, pg = gloo_group(rank, k, port)
    model = _model(args["d_model"], args["layers"])
    params = list(model.parameters())
    nbytes = [p.numel() * p.element_size() for p in params]
    budget = unit_budget(nbytes, k)  # as ``Shards`` cuts it
    index = {id(p): i for i, p in enumerate(params)}
    cut = [idx for _, idx in units(model, index, nbytes, budget)]
    owner = unit_owners(cut, [p.numel() for p in params], k)

    def bcast(t: torch.Tensor, src: int) -> None:
        pg.broadcast(t, src).wait()

    gather = ParamGather(params, owner, rank, bcast, unit_bytes=budget)
    times, digests = _slots(model, args["slots"], gather)
    mine = [p for p, o in zip(params, owner, strict=True) if o == rank]
    for p in mine:  # the optimizer's step reads the gradient of the last slot
        assert p.grad is not None
    q.put(
        {
            "rank": rank,
            "peak_param_bytes": gather.peak_bytes,
            "rest_param_bytes": gather.held,
            "opt_bytes": _opt_bytes(mine),
            "slot_s": statistics.median(times[1:]),
            "gathers_per_slot": gather.gathers / args["slots"],
            "digests": digests,
        }
    )


def _whole(args: dict) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    model = _model(args["d_model"], args["layers"])
    times, digests = _slots(model, args["slots"], None)
    params = list(model.parameters())
    return {
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "opt_bytes": _opt_bytes(params),
        "slot_s": statistics.median(times[1:]),
        "digests": digests,
    }


def _sharded(k: int, args: dict) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, k, port, args, q)) for r in range(k)]
    for p in procs:
        p.start()
    try:
        return sorted((q.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=128, help="the model's width")
    ap.add_argument("--layers", type=int, default=10, help="transformer layers")
    ap.add_argument("--slots", type=int, default=4, help="slots per rank (the first is warm-up)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="shard degrees")
    ap.add_argument("--out", default=None, help="results file (default results/)")
    a = ap.parse_args()
    args = {"d_model": a.d_model, "layers": a.layers, "slots": a.slots}
    whole = _whole(args)
    base = whole["param_bytes"] + whole["opt_bytes"]
    rows = []
    for k in a.k:
        ranks = _sharded(k, args)
        peak = max(r["peak_param_bytes"] + r["opt_bytes"] for r in ranks)
        rows.append(
            {
                "k": k,
                "peak_param_plus_opt_over_whole": peak / base,
                "peak_param_over_whole": max(r["peak_param_bytes"] for r in ranks)
                / whole["param_bytes"],
                "rest_param_over_whole": max(r["rest_param_bytes"] for r in ranks)
                / whole["param_bytes"],
                "opt_over_whole": max(r["opt_bytes"] for r in ranks) / whole["opt_bytes"],
                "slot_time_over_whole": statistics.median(r["slot_s"] for r in ranks)
                / whole["slot_s"],
                "gathers_per_slot": ranks[0]["gathers_per_slot"],
                "bitwise_equal": all(r["digests"] == whole["digests"] for r in ranks),
            }
        )
        r = rows[-1]
        print(
            f"k={k}: peak params+opt {r['peak_param_plus_opt_over_whole']:.3f} of the "
            f"whole replica (1/k = {1 / k:.3f}); params at rest "
            f"{r['rest_param_over_whole']:.3f}, peak {r['peak_param_over_whole']:.3f}; "
            f"slot time {r['slot_time_over_whole']:.2f}x; bitwise equal {r['bitwise_equal']}"
        )
    whole.pop("digests")
    path = write_result(
        "param_memory", {"machine": machine(), "args": args, "whole": whole, "rows": rows}, a.out
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
