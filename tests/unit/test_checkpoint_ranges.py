"""A checkpoint opened without its tensors (``checkpoint/ranges.py``): nothing but the
manifest, the headers and the context is read until a tensor is asked for; then exactly
that tensor's bytes are read, from every writer's file that holds a piece of it, and they
are the loader's bits. What a rank sharded at rest loads its shard with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from perdure.checkpoint import load_checkpoint, save_checkpoint, state_digest
from perdure.checkpoint.errors import CorruptCheckpointError
from perdure.checkpoint.ranges import open_lazy
from perdure.checkpoint.tensors import TORCH_DTYPES, Meta, flatten
from tests.checkpoint_support import ThreadExchange, make_state, same_bits, same_tree
from tests.unit.test_checkpoint_sharded import _save_sharded


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state written by four ranks, the optimizer by its holders: tensors split across
    writers' files."""
    paths = _save_sharded(tmp_path_factory.mktemp("ranges"), make_state(step=9))
    assert all(isinstance(p, Path) for p in paths), paths
    return Path(paths[0])


def _nbytes(lazy_index: object, key: str) -> int:
    spec = lazy_index.specs[key]  # type: ignore[attr-defined]
    return Meta(key, spec.dtype, spec.shape).nbytes


def test_opening_reads_no_tensor_and_gives_every_field_with_meta_stand_ins(written: Path) -> None:
    lazy = open_lazy(written)
    whole = load_checkpoint(written)
    assert lazy.reader.bytes_read == 0
    assert all(t.device.type == "meta" for t in lazy.loaded.model.values())
    assert {k: (t.shape, t.dtype) for k, t in lazy.loaded.model.items()} == {
        k: (t.shape, t.dtype) for k, t in whole.model.items()
    }
    assert lazy.loaded.step == whole.step
    assert same_tree([lazy.loaded.rng, lazy.loaded.decisions], [whole.rng, whole.decisions])
    lazy.reader.close()


def test_each_tensor_read_by_range_is_the_loaders_bits_and_costs_its_own_bytes(
    written: Path,
) -> None:
    lazy = open_lazy(written)
    whole = load_checkpoint(written, mmap=False)
    split = [k for k, ps in lazy.reader.pieces.items() if len({p.name for p in ps}) > 1]
    assert split, "the fixture must hold a tensor split across writers' files"
    model = {k: lazy.reader.read("model/" + k) for k in whole.model}
    assert all(same_bits(model[k], whole.model[k]) for k in whole.model)
    optimizer = lazy.resolve(lazy.loaded.optimizer)
    assert state_digest(model, optimizer) == state_digest(whole.model, whole.optimizer)
    assert lazy.reader.bytes_read == sum(_nbytes(lazy.reader.index, k) for k in lazy.reader.pieces)
    lazy.reader.close()


def test_a_split_tensor_alone_reads_exactly_its_bytes_into_the_destination(written: Path) -> None:
    lazy = open_lazy(written)
    key = next(k for k, ps in lazy.reader.pieces.items() if len({p.name for p in ps}) > 1)
    spec = lazy.reader.index.specs[key]
    dest = torch.full(spec.shape, 7, dtype=TORCH_DTYPES[spec.dtype])
    lazy.reader.read_into(key, dest)
    assert lazy.reader.bytes_read == _nbytes(lazy.reader.index, key)
    whole = load_checkpoint(written)
    assert same_bits(dest, flatten(whole.model, whole.optimizer)[0][key])
    lazy.reader.close()


def test_a_file_cut_short_is_named_when_its_tensor_is_read(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state(step=3), rank=0, world=1,
                           exchange=ThreadExchange(1))  # fmt: skip
    lazy = open_lazy(path)
    name = next(iter(lazy.reader.index.headers))
    os.truncate(Path(path) / name, lazy.reader.index.headers[name].data_start + 4)
    last = max(lazy.reader.pieces, key=lambda k: max(p.end for p in lazy.reader.pieces[k]))
    with pytest.raises(CorruptCheckpointError, match=f"{name}: truncated"):
        lazy.reader.read(last)
    lazy.reader.close()
