"""W writers holding identical replicas each write 1/W of the bytes; the result loads
exactly like a checkpoint written by one writer."""

from __future__ import annotations

import itertools
import multiprocessing as mp
from pathlib import Path

import torch

from perdure.checkpoint import load_checkpoint, save_checkpoint, state_digest
from perdure.checkpoint.plan import Chunk, plan_parts
from perdure.checkpoint.reference_reader import Checkpoint
from perdure.checkpoint.tensors import Meta
from tests.checkpoint_support import StoreExchange, free_port, make_state, same_tree

WORLD = 3


def _state(step: int = 7):  # type: ignore[no-untyped-def]
    state = make_state(step=step)
    g = torch.Generator().manual_seed(3)
    state.model["big"] = torch.randn(301, 17, generator=g)
    state.model["bigbf16"] = torch.randn(97, 5, generator=g).to(torch.bfloat16)
    return state


def _writer(root: str, port: int, rank: int, out: mp.Queue) -> None:
    try:
        ex = StoreExchange(port, rank, WORLD)
        path = save_checkpoint(root, _state(), rank=rank, world=WORLD, exchange=ex)
        ex.close()
        out.put((rank, str(path)))
    except BaseException as e:
        out.put((rank, f"error: {e!r}"))


def _save_with_three_processes(root: Path) -> Path:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_writer, args=(str(root), port, r, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    paths = set(results.values())
    assert len(paths) == 1, results
    return Path(paths.pop())


def test_three_parallel_writers_load_identically_to_one(tmp_path: Path) -> None:
    three = _save_with_three_processes(tmp_path / "three")
    one = save_checkpoint(tmp_path / "one", _state())
    a, b = load_checkpoint(three), load_checkpoint(one)
    for name in (
        "step",
        "model",
        "optimizer",
        "rng",
        "data",
        "config_hash",
        "canonical_config",
        "topology",
        "provenance",
        "decisions",
    ):
        assert same_tree(getattr(a, name), getattr(b, name)), name
    assert state_digest(a.model, a.optimizer) == state_digest(b.model, b.optimizer)
    parts = sorted(p.name for p in three.glob("*.safetensors"))
    assert parts == [f"tensors-{r:05d}-of-00003.safetensors" for r in range(WORLD)]
    sizes = [(three / p).stat().st_size for p in parts]
    assert max(sizes) < 1.5 * min(sizes), sizes
    assert len(a.manifest["tensors"]["model/big"]["chunks"]) > 1


def test_reference_reader_reads_rows_across_chunk_boundaries(tmp_path: Path) -> None:
    three = _save_with_three_processes(tmp_path)
    reader = Checkpoint(three)
    chunks = reader.manifest["tensors"]["model/big"]["chunks"]
    cut = chunks[0]["rows"][1]
    rows = reader.tensor("model/big", rows=(cut - 5, cut + 5))
    assert (rows == _state().model["big"][cut - 5 : cut + 5].numpy()).all()


def test_plan_covers_every_byte_once_and_balances() -> None:
    metas = [Meta(f"t{i}", "F32", (n, 3)) for i, n in enumerate([1000, 7, 0, 1, 500, 2000])]
    metas.append(Meta("scalar", "F32", ()))
    for world in (1, 2, 3, 5, 16):
        loads = assert_covers(plan_parts(metas, world), metas)
        assert max(loads) - min(loads) <= 12 + 4, (world, loads)


def assert_covers(parts: list[list[Chunk]], metas: list[Meta]) -> list[int]:
    """Every tensor's chunks tile its rows exactly once; returns each part's bytes."""
    for m in metas:
        chunks = sorted((c for p in parts for c in p if c.meta.key == m.key), key=lambda c: c.start)
        rows = m.shape[0] if m.shape else 0
        assert chunks[0].start == 0 and chunks[-1].stop == rows, m.key
        assert all(x.stop == y.start for x, y in itertools.pairwise(chunks)), m.key
    loads = [sum(c.byte_range[1] - c.byte_range[0] for c in p) for p in parts]
    assert sum(loads) == sum(m.nbytes for m in metas)
    return loads
