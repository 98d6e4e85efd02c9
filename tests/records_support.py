"""Helpers for the record-building tests (no tests here): one list of text records written
into every container ``perdure data build --text-field`` reads, and a BPE tokenizer trained
on them locally."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_records(limit_bytes: int = 400_000) -> list[dict]:
    """Paragraphs of the standard library's ``json`` and ``email`` packages as records
    ``{"id", "text", "n"}``, some with non-ASCII text and empty strings."""
    out: list[dict] = []
    size = 0
    for f in sorted((STDLIB / "email").glob("*.py")) + sorted((STDLIB / "json").glob("*.py")):
        for para in f.read_text(encoding="utf-8").split("\n\n"):
            out.append({"id": len(out), "text": para, "n": len(para)})
            size += len(para)
            if size >= limit_bytes:
                break
        if size >= limit_bytes:
            break
    out[3]["text"] = "ünïcödé ✓ 数据 — " + out[3]["text"]
    out[5]["text"] = ""
    return out


def write_all(root: Path, records: list[dict]) -> dict[str, Path]:
    """The same records as .jsonl, .jsonl.gz, .jsonl.zst, .parquet (several row groups)
    and a save_to_disk directory (several arrow files)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    paths = {
        "jsonl": root / "c.jsonl",
        "gz": root / "c.jsonl.gz",
        "zst": root / "c.jsonl.zst",
        "parquet": root / "c.parquet",
        "hf": root / "hf",
    }
    paths["jsonl"].write_bytes(lines)
    paths["gz"].write_bytes(gzip.compress(lines))
    paths["zst"].write_bytes(zstandard.ZstdCompressor().compress(lines))
    table = pa.Table.from_pylist(records)
    pq.write_table(table, paths["parquet"], row_group_size=max(1, len(records) // 7))
    datasets.Dataset.from_list(records).save_to_disk(str(paths["hf"]), max_shard_size=50_000)
    return paths


def train_bpe(records: list[dict], path: Path, vocab: int = 600) -> Path:
    """A byte-level BPE tokenizer trained on the records' text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((r["text"] for r in records), trainer)
    tok.save(str(path))
    return path
