from __future__ import annotations

import threading
from pathlib import Path

import fsspec
import numpy as np

from perdure.data import Dataset, SlotLoader
from tests.unit.test_data_support import ROW, copy_to_memory, make_dataset


def test_a_dataset_streams_from_memory_urls_like_a_local_one(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    url = copy_to_memory(out, "memory://stream/ds")
    with Dataset.open(str(out)) as local, Dataset.open(url, cache_dir=str(tmp_path / "c")) as mem:
        assert mem.version_id == local.version_id == m.version_id
        ids = np.arange(mem.num_samples)[::-3]
        assert np.array_equal(mem.read(ids), local.read(ids))


def test_only_the_parts_a_read_needs_are_downloaded(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    url = copy_to_memory(out, "memory://stream/needed")
    with Dataset.open(url, cache_dir=str(tmp_path / "c")) as ds:
        lo, hi = ds.part_range(4)
        ds.read(np.arange(lo, hi))
        ds.read(np.array([lo]))
        assert ds.store.downloads == 1
        assert sorted(p.name for p in (tmp_path / "c").rglob("*.bin")) == ["shard-00004.bin"]


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    url = copy_to_memory(out, "memory://stream/lru")
    part_bytes = m.parts[0].bytes
    cache = tmp_path / "c"
    with Dataset.open(url, cache_dir=str(cache), cache_mb=3 * part_bytes / (1 << 20)) as ds:

        def touch(k: int) -> None:
            ds.read(np.array([ds.part_range(k)[0]]))

        for k in (0, 1, 2, 0, 3):  # 1 is least recently used when 3 arrives
            touch(k)
            on_disk = sum(p.stat().st_size for p in cache.rglob("*.bin"))
            assert on_disk <= 3 * part_bytes
        names = sorted(p.name for p in cache.rglob("*.bin"))
        assert names == ["shard-00000.bin", "shard-00002.bin", "shard-00003.bin"]
        assert ds.store.evictions == 1
        touch(1)  # evicted parts come back, downloaded and verified again
        assert ds.store.downloads == 5
        assert np.array_equal(ds.read(np.arange(ds.num_samples)), Dataset.open(str(out)).read(
            np.arange(ds.num_samples)))  # fmt: skip


def test_a_corrupt_remote_part_fails_its_checksum_on_first_read(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    url = copy_to_memory(out, "memory://stream/corrupt")
    fs = fsspec.filesystem("memory")
    path = "/stream/corrupt/shard-00001.bin"
    data = bytearray(fs.cat_file(path))
    data[0] ^= 1
    fs.pipe_file(path, bytes(data))
    with Dataset.open(url, cache_dir=str(tmp_path / "c")) as ds:
        loader = SlotLoader(ds, seed=0, global_batch=ds.num_samples - ds.num_samples % 4, slots=4)
        batches = [loader.batch(0, s) for s in range(4)]
        assert any(b.bad_parts == (1,) for b in batches)
        assert [e.parts for e in loader.pending_quarantine()] == [(1,)]
        rows = sum(b.tokens.shape[0] for b in batches)
        assert rows == loader.global_batch and batches[0].tokens.shape[1] == ROW
        loader.close()


def test_prefetched_batches_equal_foreground_ones_and_never_go_stale(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    ds = Dataset.open(str(out))
    with SlotLoader(ds, seed=1, global_batch=8, slots=2, prefetch_steps=2) as pre, \
         SlotLoader(ds, seed=1, global_batch=8, slots=2, prefetch_steps=0) as ref:  # fmt: skip
        for t in range(20):
            pre.prefetch(t + 1, [0, 1])
            for s in (0, 1):
                assert np.array_equal(pre.batch(t, s).tokens, ref.batch(t, s).tokens)
        pre.prefetch(21, [0, 1])
        part = int(ref.batch(21, 0).parts[0])
        pre.quarantine([part], 21, "after prefetch")  # the read-ahead is now stale
        ref.quarantine([part], 21, "after prefetch")
        assert part not in pre.batch(21, 0).parts
        assert np.array_equal(pre.batch(21, 0).sample_ids, ref.batch(21, 0).sample_ids)
        assert pre._prefetcher.pending() <= 2 * 2
    assert not [t for t in threading.enumerate() if t.name.startswith("perdure-prefetch")]
