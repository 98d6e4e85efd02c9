"""Benchmark of perdure.data, side by side with the baselines it must match or beat.

1. Throughput: ``SlotLoader.batch`` over every slot of consecutive steps (order lookup,
   quarantine check, part grouping, int64 tokens) against a plain ``np.memmap`` read of
   the same sample ids from the same part files (ids precomputed, grouped by part, int64
   out). Goal: ratio >= 0.9.
2. Time to first batch: open the dataset, restore a data state, read slot 0, at step 10**7
   against step 0. Goal: ratio about 1.
3. Resume against the common practice of iterating and discarding N batches (a shuffled
   sequential loader, data read as a DataLoader reads it), at several depths.

Every measurement is repeated; each repeat gives one ratio; we report min/median/max of
the ratios. Results: ``benchmarks/results/data.json``. ``--quick`` for a short run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from perdure.data import Dataset, SlotLoader, build_dataset

ROOT = Path(__file__).resolve().parent
SEED = 1234


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _memmaps(ds_dir: Path, ds: Dataset) -> list[np.memmap]:
    m = ds.manifest
    return [np.memmap(ds_dir / s.file, dtype=m.np_dtype(), mode="r",
                      shape=(s.samples, m.seq_len + 1)) for s in m.parts]  # fmt: skip


def _memmap_read(mms: list[np.memmap], starts: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """What one writes by hand: part of each id, one gather per part, int64 out."""
    parts = np.searchsorted(starts, ids, side="right") - 1
    out = np.empty((ids.size, mms[0].shape[1]), dtype=np.int64)
    for k in np.unique(parts):
        sel = parts == k
        out[sel] = mms[k][ids[sel] - starts[k]]
    return out


def bench_throughput(ds_dir: Path, batch: int, slots: int, steps: int, repeats: int) -> dict:
    ds = Dataset.open(str(ds_dir))
    loader = SlotLoader(ds, seed=SEED, global_batch=batch, slots=slots, prefetch_steps=0)
    ids = [loader.samples(t, s) for t in range(steps) for s in range(slots)]
    mms = _memmaps(ds_dir, ds)

    def ours() -> None:
        for t in range(steps):
            for s in range(slots):
                loader.batch(t, s)

    def base() -> None:
        for x in ids:
            _memmap_read(mms, ds.starts, x)

    ours(), base()  # warm: page cache, checksums, step-id cache sizes
    samples = steps * batch
    rows: list[dict[str, float]] = []
    for _ in range(repeats):
        loader._ids_cache.clear()  # every repeat pays for its order lookups
        loader._order_cache.clear()
        t_ours, t_base = _time(ours), _time(base)
        rows.append({"ours_sps": samples / t_ours, "memmap_sps": samples / t_base,
                     "ratio": t_base / t_ours})  # fmt: skip
    loader.close()
    return {
        "global_batch": batch, "slots": slots, "steps": steps, "seq_len": ds.seq_len,
        "ours_samples_per_s": _summary([r["ours_sps"] for r in rows]),
        "memmap_samples_per_s": _summary([r["memmap_sps"] for r in rows]),
        "ratio_ours_over_memmap": _summary([r["ratio"] for r in rows]),
    }  # fmt: skip


def _first_batch(ds_dir: Path, step: int, batch: int, slots: int) -> float:
    def run() -> None:
        ds = Dataset.open(str(ds_dir))
        state = SlotLoader(ds, seed=SEED, global_batch=batch, slots=slots).state(step)
        with SlotLoader.from_state(ds, state, slots=slots) as loader:
            loader.batch(step, 0)

    return _time(run)


def bench_first_batch(ds_dir: Path, batch: int, slots: int, repeats: int) -> dict:
    far = 10**7
    _first_batch(ds_dir, 0, batch, slots)
    pairs = [(_first_batch(ds_dir, 0, batch, slots), _first_batch(ds_dir, far, batch, slots))
             for _ in range(repeats)]  # fmt: skip
    return {
        "step": far,
        "seconds_at_step_0": _summary([a for a, _ in pairs]),
        "seconds_at_far_step": _summary([b for _, b in pairs]),
        "ratio_far_over_0": _summary([b / a for a, b in pairs]),
    }


def _skip_loader(ds: Dataset, batch: int) -> Iterator[np.ndarray]:
    """The common practice: a per-epoch shuffled index array, batches read in turn."""
    n, epoch = ds.num_samples, 0
    while True:
        perm = np.random.default_rng(SEED + epoch).permutation(n)
        for i in range(0, n - batch + 1, batch):
            yield ds.read(perm[i : i + batch])
        epoch += 1


def bench_skip(ds_dir: Path, batch: int, slots: int, depths: list[int], repeats: int) -> dict:
    out = {}
    for depth in depths:
        rows = []
        for _ in range(repeats):

            def skip(depth: int = depth) -> None:  # opens the dataset too, as ours does
                it = _skip_loader(Dataset.open(str(ds_dir)), batch)
                for _ in range(depth):
                    next(it)
                next(it)

            t_skip = _time(skip)
            t_ours = _first_batch(ds_dir, depth, batch, slots)
            rows.append((t_skip, t_ours))
        out[str(depth)] = {
            "skip_seconds": _summary([a for a, _ in rows]),
            "ours_seconds": _summary([b for _, b in rows]),
            "ratio_skip_over_ours": _summary([a / b for a, b in rows]),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small data and few repeats")
    ap.add_argument("--out", default=str(ROOT / "results" / "data.json"))
    args = ap.parse_args()
    quick = args.quick
    repeats = 3 if quick else 9
    work = Path(tempfile.mkdtemp(prefix="perdure-bench-data-"))
    stdlib = sysconfig.get_paths()["stdlib"]
    mb = 4 if quick else 10
    t_build = _time(lambda: build_dataset([stdlib], str(work / "ds128"), seq_len=128,
                                          part_mb=1, include="*.py", max_mb=mb))  # fmt: skip
    results: dict = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "numpy": np.__version__,
        },
        "quick": quick,
        "build": {"source_mb": mb, "seconds": t_build},
        "throughput": [bench_throughput(work / "ds128", 512, 8, 20 if quick else 60, repeats)],
    }
    if not quick:
        build_dataset([stdlib], str(work / "ds1024"), seq_len=1024, part_mb=4,
                      include="*.py", max_mb=mb)  # fmt: skip
        for batch in (256, 2048):  # 32 and 256 samples of 1025 tokens per slot
            results["throughput"].append(
                bench_throughput(work / "ds1024", batch, 8, 60 * 256 // batch, repeats)
            )
    results["first_batch"] = bench_first_batch(work / "ds128", 512, 8, repeats)
    depths = [10, 100, 1000] if quick else [10, 100, 1000, 5000]
    results["resume_vs_skip"] = bench_skip(work / "ds128", 512, 8, depths, 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    _print(results)
    return 0


def _print(r: dict) -> None:
    def fmt(s: dict) -> str:
        return f"{s['min']:.3g} / {s['median']:.3g} / {s['max']:.3g}"

    print(f"build: {r['build']['source_mb']} MiB of stdlib source in {r['build']['seconds']:.2f} s")
    for t in r["throughput"]:
        print(f"throughput seq_len {t['seq_len']}, B={t['global_batch']}, S={t['slots']}: "
              f"ours/memmap (min/median/max) {fmt(t['ratio_ours_over_memmap'])}; "
              f"ours {t['ours_samples_per_s']['median']:.0f} samples/s")  # fmt: skip
    f = r["first_batch"]
    print(f"first batch at step {f['step']} / at step 0: {fmt(f['ratio_far_over_0'])} "
          f"(step 0: {f['seconds_at_step_0']['median'] * 1e3:.1f} ms)")  # fmt: skip
    for depth, s in r["resume_vs_skip"].items():
        print(f"resume at step {depth}: skip-N / ours {fmt(s['ratio_skip_over_ours'])} "
              f"(skip {s['skip_seconds']['median'] * 1e3:.1f} ms, "
              f"ours {s['ours_seconds']['median'] * 1e3:.1f} ms)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
