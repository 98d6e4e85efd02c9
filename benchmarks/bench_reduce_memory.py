"""Peak memory of one rank's reduction against its slot count: the exact reduction's two
forms (``train.reduction_exponents = "step"`` and ``"carried"``) beside a plain float32
accumulation in place (what DDP's gradient accumulation keeps: the gradient and its sum).

    .venv/bin/python benchmarks/bench_reduce_memory.py              # P = 4M, S = 1, 4, 16
    .venv/bin/python benchmarks/bench_reduce_memory.py --values-m 16

Each (form, S) runs in a fresh spawned process (one thread), one member, so that the
peak resident set (``ru_maxrss``) is that form's alone: measured after torch is imported
and one throwaway pass has warmed the allocator and the kernels, then the step's buffers
as the step runner makes them (``step``: one float32 buffer per slot, then the reducer's
integer accumulator and result; ``carried``: one buffer that each slot is computed into
and added from, the accumulator; ``plain``: one gradient buffer and one float32 sum),
each slot's values written in place (``normal_``). Reported in units of ``4 P`` bytes (one
float32 copy of the gradient): "peak" is everything the pass holds, "scratch" is the peak
less the one gradient buffer every form needs.

Results: ``benchmarks/results/reduce_memory.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import InlineComm, machine, write_result

FORMS = ("plain", "step", "carried")


def _rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _pass(form: str, n: int, slots: int) -> None:  # pragma: no cover - in a child
    from datetime import timedelta

    import torch

    from perdure.runtime.comm.carried import CarriedReducer
    from perdure.runtime.comm.exact import ExactReducer

    timeout = timedelta(seconds=60)
    if form == "plain":
        grad, total = torch.empty(n), torch.zeros(n)
        for _ in range(slots):
            grad.normal_()
            total += grad
    elif form == "step":
        bufs = [torch.empty(n).normal_() for _ in range(slots)]
        ExactReducer(0, 1, slots=slots, bits=64, block=256).reduce(None, bufs, timeout)
    else:
        red, buf = CarriedReducer(0, 1, slots=slots, block=256), torch.empty(n)
        red.open(buf, torch.zeros(-(-n // 256), dtype=torch.int32) + 8)
        for _ in range(slots):
            buf.normal_()
            red.add(buf)
        red.finish(InlineComm(), buf, timeout=timeout).result()


def _child(form: str, n: int, slots: int, q) -> None:  # pragma: no cover - in a child
    import torch

    torch.set_num_threads(1)
    _pass(form, 1 << 16, 2)  # warm-up: the kernels built and loaded, the allocator primed
    base = _rss_bytes()
    t0 = time.perf_counter()
    _pass(form, n, slots)
    q.put({"peak_bytes": _rss_bytes() - base, "seconds": time.perf_counter() - t0})


def measure(form: str, n: int, slots: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(form, n, slots, q))
    p.start()
    try:
        return q.get(timeout=600)
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values-m", type=float, default=4, help="P, in millions of values")
    ap.add_argument("--slots", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    n = int(a.values_m * 1e6)
    unit = 4 * n
    rows = []
    for slots in a.slots:
        for form in FORMS:
            r = measure(form, n, slots)
            peak = r["peak_bytes"] / unit
            row = {"form": form, "slots": slots, "peak_p": peak, "scratch_p": peak - 1, **r}
            rows.append(row)
            print(
                f"S={slots:>3} {form:>8}: peak {peak:5.2f} P, scratch {peak - 1:5.2f} P "
                f"({r['seconds']:.2f} s)",
                flush=True,
            )
    data = {
        "name": "reduce_memory",
        "machine": machine(),
        "values": n,
        "goal": "peak scratch per rank <= 2 P whatever the slot count",
        "rows": rows,
    }
    print(f"wrote {write_result('reduce_memory', data, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
