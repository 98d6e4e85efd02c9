"""How often a carried prediction makes a step compute twice, per form of the exact
reduction's exponents, on one replica of the tests' small tiny_lm (8 slots, AdamW).

    .venv/bin/python benchmarks/bench_refits.py            # 150 steps per form
    .venv/bin/python benchmarks/bench_refits.py --steps 40

The step runner of ``perdure/runtime/step.py`` is driven in process (one member, no
coordinator): each step's gradient, then the update. ``carried`` predicts one exponent per
bucket of up to 1M values (64-bit); ``streamed`` one per block of 256 (32-bit here), whose
misses go through the outlier lane and compute twice only past the outliers' cap. The
first step always computes twice (nothing is predicted yet) and is counted.

Results: ``benchmarks/results/refits.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import write_result

FORMS: dict[str, dict[str, Any]] = {
    "carried_int64": {"reduction": "exact", "reduction_exponents": "carried", "reduction_bits": 64},
    "streamed_int32": {
        "reduction": "exact",
        "reduction_exponents": "streamed",
        "reduction_bits": 32,
    },
    "streamed_int64": {
        "reduction": "exact",
        "reduction_exponents": "streamed",
        "reduction_bits": 64,
    },
}


def one_form(dataset: Path, train: dict[str, Any], steps: int) -> dict[str, Any]:
    from tests.integration.test_carried import _runner
    from tests.runtime_support import small_config

    events: list[dict[str, Any]] = []
    run = _runner(small_config(dataset, workers=1, train=train, steps=steps), events)
    t0 = time.monotonic()
    for t in range(steps):
        run.tr.apply(t, run.gradient(t, time.monotonic()))
    refits = [e["step"] for e in events if e["event"] == "exponents_refit"]
    # the first step's second pass logs no event (nothing was predicted): count it too
    return {
        "steps": steps,
        "computed_twice": 1 + len(refits),
        "refit_steps": refits,
        "s_per_step": round((time.monotonic() - t0) / steps, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", help="result path (default: benchmarks/results/refits.json)")
    args = ap.parse_args()
    from tests.runtime_support import build_small_dataset

    dataset = build_small_dataset(Path(tempfile.mkdtemp()) / "ds")
    rows = {name: one_form(dataset, train, args.steps) for name, train in FORMS.items()}
    for name, row in rows.items():
        print(
            f"{name:16s} computed twice {row['computed_twice']:3d} of {row['steps']} steps "
            f"({row['s_per_step']:.3f} s/step)"
        )
    write_result("refits", {"forms": rows}, args.out)


if __name__ == "__main__":
    main()
