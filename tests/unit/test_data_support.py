"""Helpers shared by the data tests (no tests here): small corpora and datasets."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from perdure.data import Manifest, build_dataset

SEQ_LEN = 15
ROW = SEQ_LEN + 1
PART_MB = 16 * ROW / (1 << 20)
"""16 samples of 16 one-byte tokens per part: many small parts."""


def write_corpus(root: Path, files: int = 8, size: int = 600, seed: int = 0) -> Path:
    """Text files with pseudo-random words in nested directories (deterministic)."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "shard", "slot", "step", "epoch", "perdure"]
    for i in range(files):
        path = root / f"d{i % 3}" / f"f{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = " ".join(rng.choice(words) for _ in range(size // 6))
        path.write_text(text[:size] + "\n")
    return root


def make_dataset(tmp: Path, name: str = "ds", **kw: object) -> tuple[Path, Manifest]:
    corpus = tmp / f"{name}-src"
    if not corpus.exists():
        write_corpus(corpus)
    out = tmp / name
    opts: dict = {"seq_len": SEQ_LEN, "part_mb": PART_MB, **kw}
    return out, build_dataset([str(corpus)], str(out), **opts)


def copy_to_memory(src: Path, url: str) -> str:
    """Copy a dataset directory to an fsspec memory:// URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in sorted(src.iterdir()):
        fs.pipe_file(f"{url.removeprefix('memory://')}/{f.name}", f.read_bytes())
    return url


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
