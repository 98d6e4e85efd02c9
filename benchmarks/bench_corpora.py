"""Real corpora in: build throughput with a BPE tokenizer against ``datasets.map``, and an
in-place import against a copy.

``python benchmarks/bench_corpora.py [--text-mb 24] [--import-gb 2] [--repeats 2]`` writes
``benchmarks/results/corpora.json``. Run it under ``flock /tmp/perdure-bench.lock``.

- *build*: records made from the standard library's ``*.py`` text (paragraphs, no
  download), saved with ``datasets`` ``save_to_disk``; a byte-level BPE tokenizer
  (``tokenizers``, vocabulary 8000) trained locally on them. Side by side on the same
  directory and the same cores: ``perdure data build --text-field text`` on 1 and 2
  processes, and ``datasets.Dataset.map(batched=True, num_proc=1|2)`` calling the same
  tokenizer (``encode_batch``; ``TOKENIZERS_PARALLELISM=false`` for both, so each process
  tokenizes on one thread), and the floor: reading every record's text. Each run is a
  fresh process; its peak RSS (``ru_maxrss``, itself and its largest child) is reported.
- *import*: a raw ``uint16`` token file of ``--import-gb`` GiB: ``perdure data import``
  copying it into parts, the same ``--in-place``, and the floor of one SHA-256 of it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import PY, REPO, RESULTS, machine

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
       "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}  # fmt: skip

CHILD = r"""
import json, os, resource, sys, time
kind, src, out, procs, tok = sys.argv[1:6]
procs = int(procs)
import datasets, tokenizers
from perdure.data import build_dataset
t0 = time.perf_counter()
if kind == "perdure":
    m = build_dataset([src], out, text_field="text", tokenizer="perdure.data.hf:tokenizer_json",
                      tokenizer_file=tok, seq_len=2047, processes=procs)
    tokens = m.sources["tokens"]
elif kind == "floor":
    import datasets
    ds = datasets.load_from_disk(src)
    tokens = 0
    for b in ds.with_format("arrow").iter(8192):
        tokens += sum(len(x) for x in b["text"].to_pylist())
took = time.perf_counter() - t0
me = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": took, "tokens": tokens, "rss_mib": me / 1024,
                  "child_rss_mib": kids / 1024}))
"""

HF_TIMED = r"""
import os, sys, time, json, resource
import datasets
from tokenizers import Tokenizer
src, out, procs, tok = sys.argv[1:5]
procs = int(procs)
datasets.disable_caching()
t = Tokenizer.from_file(tok)
def enc(batch):
    return {"ids": [e.ids for e in t.encode_batch(batch["text"], add_special_tokens=False)]}
t0 = time.perf_counter()
ds = datasets.load_from_disk(src)
res = ds.map(enc, batched=True, num_proc=procs if procs > 1 else None,
             remove_columns=ds.column_names, cache_file_name=os.path.join(out, "ids.arrow"))
took = time.perf_counter() - t0
me = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"seconds": took, "rss_mib": me / 1024, "child_rss_mib": kids / 1024}))
"""


def make_corpus(root: Path, text_mb: float) -> tuple[Path, Path, int]:
    import sysconfig

    import datasets

    sys.path.insert(0, str(REPO))
    from tests.records_support import train_bpe

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    records, size, limit = [], 0, int(text_mb * (1 << 20))
    files = sorted(stdlib.rglob("*.py"), key=lambda p: p.as_posix())
    while size < limit:  # the stdlib again if it is smaller than asked
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for para in text.split("\n\n"):
                records.append({"text": para})
                size += len(para.encode())
            if size >= limit:
                break
    src = root / "corpus"
    datasets.Dataset.from_list(records).save_to_disk(str(src))
    tok = train_bpe(records[:20000], root / "tok.json", vocab=8000)
    return src, tok, size


def run_child(args: list[str], script: str = CHILD) -> dict[str, Any]:
    res = subprocess.run([PY, "-c", script, *args], capture_output=True, text=True, env=ENV,
                         timeout=3600, cwd=REPO)  # fmt: skip
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def bench_build(root: Path, text_mb: float, repeats: int) -> dict[str, Any]:
    src, tok, size = make_corpus(root, text_mb)
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in range(repeats):
        for procs in (1, 2):
            out = root / f"out-{procs}-{r}"
            rows.setdefault(f"perdure_p{procs}", []).append(
                run_child(["perdure", str(src), str(out), str(procs), str(tok)])
            )
            shutil.rmtree(out, ignore_errors=True)
            hf_out = root / f"hf-{procs}-{r}"
            hf_out.mkdir()
            rows.setdefault(f"hf_map_p{procs}", []).append(
                run_child([str(src), str(hf_out), str(procs), str(tok)], HF_TIMED)
            )
            shutil.rmtree(hf_out, ignore_errors=True)
        rows.setdefault("floor_read", []).append(run_child(["floor", str(src), "-", "1", str(tok)]))
    tokens = rows["perdure_p1"][0]["tokens"]
    summary: dict[str, Any] = {"text_bytes": size, "tokens": tokens, "runs": rows}
    best = {k: min(x["seconds"] for x in v) for k, v in rows.items()}
    for k, s in best.items():
        summary[k] = {
            "best_s": round(s, 3),
            "mb_per_s": round(size / s / 1e6, 2),
            "tokens_per_s": round(tokens / s),
            "peak_rss_mib": round(max(x["rss_mib"] for x in rows[k]), 1),
            "peak_child_rss_mib": round(max(x["child_rss_mib"] for x in rows[k]), 1),
        }
    summary["ratios"] = {
        "perdure_p2_vs_hf_map_p2": round(best["hf_map_p2"] / best["perdure_p2"], 2),
        "perdure_p2_vs_perdure_p1": round(best["perdure_p1"] / best["perdure_p2"], 2),
        "perdure_p1_vs_hf_map_p1": round(best["hf_map_p1"] / best["perdure_p1"], 2),
        "floor_vs_perdure_p2": round(best["perdure_p2"] / best["floor_read"], 2),
    }
    return summary


def bench_import(root: Path, gb: float) -> dict[str, Any]:
    import hashlib

    import numpy as np

    raw = root / "tokens.bin"
    n = int(gb * (1 << 30)) // 2
    with open(raw, "wb") as f:
        step = 1 << 26
        for a in range(0, n, step):
            rng = np.random.default_rng(a)
            f.write(rng.integers(0, 50257, size=min(step, n - a), dtype=np.uint16).tobytes())
    out: dict[str, Any] = {"file_bytes": raw.stat().st_size}
    t0 = time.perf_counter()
    h = hashlib.sha256()
    with open(raw, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    out["sha256_once_s"] = round(time.perf_counter() - t0, 3)
    for mode in ("in_place", "copy"):
        dest = root / f"imp-{mode}"
        flags = ["--in-place"] if mode == "in_place" else []
        cmd = [PY, "-m", "perdure", "data", "import", str(raw), "--out", str(dest), "--dtype",
               "uint16", "--seq-len", "2047", "--vocab-size", "50257", *flags]  # fmt: skip
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=3600)
        took = time.perf_counter() - t0
        if res.returncode:
            out[mode] = {"error": res.stderr[-2000:]}
            continue
        written = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        out[mode] = {"seconds": round(took, 3), "bytes_written": written,
                     "vs_sha256_once": round(took / out["sha256_once_s"], 2),
                     "children_peak_rss_mib_so_far": round(rss, 1)}  # fmt: skip
        shutil.rmtree(dest, ignore_errors=True)
    raw.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--text-mb", type=float, default=24.0)
    ap.add_argument("--import-gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", choices=["build", "import"], default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    root = Path(tempfile.mkdtemp(prefix="perdure-bench-corpora-"))
    try:
        if args.only in (None, "build"):
            result["build"] = bench_build(root, args.text_mb, args.repeats)
            print(json.dumps(result["build"]["ratios"]), flush=True)
        if args.only in (None, "import"):
            result["import"] = bench_import(root, args.import_gb)
            print(json.dumps(result["import"]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["loadavg_at_end"] = list(os.getloadavg())
    RESULTS.mkdir(exist_ok=True)
    name = "corpora.json" if args.only is None else f"corpora-{args.only}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2)[:4000])


if __name__ == "__main__":
    main()
