"""Fuzz the checkpoint format: count how mutated checkpoints are answered.

Writes two small real checkpoints (one writer; two writers with a split tensor), then for
each input copies one, applies a mutation from ``tests/checkpoint_fuzzing.py`` (bit
flips, truncations, manifest digits and field edits with and without a fresh seal,
format 1.0 manifests, non-UTF-8 bytes, context and header edits with their checksums
fixed, names leaving the checkpoint) and runs the loader (mmap and read), ``verify`` and
the reference reader. Each input gets one verdict: ``clean error`` (every check raised
the format's own error), ``identical`` (every check loaded the original state bitwise),
``traceback`` (some check raised anything else), ``silent load`` (some check loaded
changed state) or ``disagreement`` (checks differ). The last three must be 0.

    python benchmarks/fuzz_checkpoint.py [--inputs 3000] [--seed 0] [--kinds digit,...]

Prints a table per mutation kind and writes ``benchmarks/results/fuzz_checkpoint.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)

from tests import checkpoint_fuzzing as fz

OUT = Path(__file__).resolve().parent / "results" / "fuzz_checkpoint.json"


def run(inputs: int, seed: int, kinds: list[str]) -> fz.Tally:
    tally = fz.Tally()
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        bases = [(b, fz.expected(b)) for b in fz.build_bases(Path(tmp) / "bases")]
        for i in range(inputs):
            base, want = bases[i % len(bases)]
            kind = kinds[(i // len(bases)) % len(kinds)]
            with tempfile.TemporaryDirectory(dir=tmp) as work:
                fz.mutate_and_judge(
                    base, want, Path(work), kind, random.Random(rnd.random()), tally
                )
    return tally


def table(tally: fz.Tally, kinds: list[str]) -> str:
    head = "| mutation | inputs | " + " | ".join(fz.VERDICTS) + " |"
    lines = [head, "|" + "---|" * (2 + len(fz.VERDICTS))]
    for kind in [*kinds, "all"]:
        counts = [
            sum(n for (k, v), n in tally.per_kind.items() if v == verdict and kind in (k, "all"))
            for verdict in fz.VERDICTS
        ]
        lines.append(f"| {kind} | {sum(counts)} | " + " | ".join(map(str, counts)) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(fz.MUTATIONS), help="comma-separated")
    p.add_argument("--out", type=Path, default=OUT, help="where the JSON record goes")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(fz.MUTATIONS))
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {', '.join(fz.MUTATIONS)}")
    t0 = time.perf_counter()
    tally = run(args.inputs, args.seed, kinds)
    seconds = time.perf_counter() - t0
    print(table(tally, kinds))
    print(tally.summary(), f"({seconds:.0f} s)")
    for line in tally.failures[:20]:
        print("  " + line[:400])
    args.out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/fuzz_checkpoint.py " + " ".join(argv),
                "seed": args.seed,
                "seconds": round(seconds, 1),
                "summary": tally.summary(),
                "verdicts": dict(tally.verdicts),
                "per_kind": {f"{k}: {v}": n for (k, v), n in sorted(tally.per_kind.items())},
                "per_check": dict(sorted(tally.per_check.items())),
                "failures": tally.failures[:50],
            },
            indent=1,
        )
        + "\n"
    )
    bad = sum(tally.verdicts[v] for v in ("traceback", "silent load", "disagreement"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
