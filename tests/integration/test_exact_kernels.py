"""The fused kernels of the exact reduction give the torch path's bits, value for value, and
a machine that cannot build them keeps the torch path."""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from perdure.launch.preflight import preflight
from perdure.runtime.comm import exact, exact_kernels
from perdure.runtime.comm.exact import ExactReducer, fused_kernels
from perdure.runtime.comm.readiness import Readiness
from tests.runtime_support import small_config

BLOCK = 256
T = timedelta(seconds=30)

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here"
)


def _hard_slots(slots: int, n: int, seed: int, bits: int = 64) -> list[torch.Tensor]:
    """Heavy tails, and blocks that are all subnormal, all zero, huge, or exact halves
    after scaling (ties for the rounding: the block's peak makes its scale 2**0), in every
    slot."""
    headroom = math.ceil(math.log2(slots)) if slots > 1 else 0
    tie_peak = 2.0 ** (bits - 3 - headroom)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(slots):
        b = torch.randn(n, generator=g) * torch.exp(6 * torch.randn(n, generator=g))
        b[:BLOCK] *= 1e-40  # subnormal
        b[BLOCK : 2 * BLOCK] = 0.0
        b[2 * BLOCK + 5] = -0.0
        b[3 * BLOCK : 4 * BLOCK] = torch.randint(-8, 8, (BLOCK,), generator=g) + 0.5
        b[3 * BLOCK] = tie_peak
        b[4 * BLOCK : 5 * BLOCK] = torch.randn(BLOCK, generator=g).clamp(-3, 3) * 1e37
        b[4 * BLOCK] = 3.4e38 / slots  # the largest finite sum
        b[-3:] = torch.tensor([1e-45, -1e-45, 7.0])
        out.append(b)
    return out


def _both(bufs: list[torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, torch) results of one member summing ``bufs``."""
    ref = ExactReducer(0, 1, slots=len(bufs), bits=bits, block=BLOCK, fused=False)
    fused = ExactReducer(0, 1, slots=len(bufs), bits=bits, block=BLOCK)
    assert fused.kernels is not None, "the kernels did not build where a compiler is"
    want = ref.reduce(None, [b.clone() for b in bufs], T).clone()
    return fused.reduce(None, [b.clone() for b in bufs], T).clone(), want


@needs_cc
@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("slots", [1, 2, 3, 8])
def test_the_fused_kernels_give_the_torch_paths_bits(bits: int, slots: int) -> None:
    for n in (5 * BLOCK + 3, 7 * BLOCK, 6 * BLOCK + BLOCK - 1):  # partial blocks, or none
        got, want = _both(_hard_slots(slots, n, n + slots, bits), bits)
        assert torch.equal(got, want), (bits, slots, n)


@needs_cc
@pytest.mark.parametrize("bits", [32, 64])
def test_the_fused_kernels_give_the_torch_paths_bits_over_several_buckets(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(exact, "CHUNK", 4 * BLOCK)
    exact._bucket_ranges.cache_clear()
    try:
        got, want = _both(_hard_slots(3, 13 * BLOCK + 100, 5, bits), bits)
    finally:
        exact._bucket_ranges.cache_clear()
    assert torch.equal(got, want)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_way_back_rounds_an_integer_to_float32_once_as_torch_does(dtype: torch.dtype) -> None:
    """Integers whose rounding to float32 through float64 would differ (2**60 + 2**36 + 1
    is a tie in float64 and not in float32), and random ones over the whole range."""
    kernels = fused_kernels()
    assert kernels is not None
    top = 2**62 if dtype == torch.int64 else 2**30
    g = torch.Generator().manual_seed(7)
    acc = torch.randint(-top, top, (4 * BLOCK,), generator=g, dtype=dtype)
    if dtype == torch.int64:
        acc[:4] = torch.tensor([2**60 + 2**36 + 1, -(2**60 + 2**36 + 1), 2**53 + 1, -(2**62)])
    inv = torch.ldexp(torch.ones(4), torch.tensor([-126, -40, 0, 30]))
    out = torch.empty(acc.numel())
    kernels.back(out, acc, inv, (0, acc.numel()), BLOCK)
    want = acc.view(4, BLOCK).to(torch.float32) * inv[:, None]
    assert torch.equal(out, want.view(-1))


@needs_cc
@pytest.mark.parametrize("bits", [32, 64])
def test_a_non_finite_value_is_zeroed_by_the_fused_path_as_by_the_torch_path(bits: int) -> None:
    bufs = _hard_slots(3, 6 * BLOCK + 10, seed=1)
    bufs[1][7], bufs[2][BLOCK + 1], bufs[2][-1] = float("nan"), float("inf"), float("-inf")
    got, want = _both(bufs, bits)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@needs_cc
def test_slots_the_kernels_cannot_take_go_through_the_torch_ops_with_the_same_bits() -> None:
    bufs = _hard_slots(2, 6 * BLOCK, seed=2)
    strided = [torch.stack([b, b], dim=1)[:, 0] for b in bufs]  # not contiguous
    reducer = ExactReducer(0, 1, slots=2, bits=64, block=BLOCK)
    assert reducer._fused(strided) is None
    got = reducer.reduce(None, strided, T)
    assert torch.equal(got, _both(bufs, 64)[1])


class _OneMember:
    """A comm for a one-member epoch: ``submit`` runs the job on a thread of its own."""

    pg = None

    def submit(self, fn: Callable[[], torch.Tensor]) -> Future[torch.Tensor]:
        fut: Future[torch.Tensor] = Future()
        threading.Thread(target=lambda: fut.set_result(fn()), daemon=True).start()
        return fut


@needs_cc
@pytest.mark.parametrize("bits", [32, 64])
def test_the_other_slots_peaks_are_taken_while_the_last_slot_is_not_final(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    bufs = _hard_slots(4, 9 * BLOCK + 7, 3, bits)
    bufs[1][5] = float("nan")  # zeroed, as by the reference, after the early pass saw it
    want = _both(bufs, bits)[1]
    reducer = ExactReducer(0, 1, slots=4, bits=bits, block=BLOCK)
    assert reducer.kernels is not None
    seen: list[int] = []
    peaks = reducer.kernels.peaks

    def spy(slots: list[torch.Tensor], *a: object, **k: object) -> bool:
        seen.append(len(slots))
        return peaks(slots, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(reducer.kernels, "peaks", spy)  # the shared kernels: undone after
    ready, mine = Readiness(), [b.clone() for b in bufs]
    last = mine[-1].clone()
    mine[-1].zero_()  # its backward has not run yet
    fut = reducer.start(_OneMember(), mine, timeout=T, ready=ready)
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [3] and not fut.done()
    mine[-1].copy_(last)
    ready.advance(mine[-1].numel())
    assert torch.equal(fut.result(timeout=30), want)
    assert seen[:2] == [3, 1]


def test_without_a_compiler_the_build_says_why_once_and_the_torch_path_remains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="perdure.exact"):
        assert exact_kernels.build(tmp_path, "/nonexistent/cc") is None
    lines = [r.getMessage() for r in caplog.records if r.name == "perdure.exact"]
    assert len(lines) == 1 and "using the torch path" in lines[0], lines


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(exact_kernels.ENV_SWITCH, "0")
    assert exact_kernels.load.__wrapped__() is None


@needs_cc
def test_a_second_build_in_the_same_directory_reuses_the_first(tmp_path: Path) -> None:
    first = exact_kernels.build(tmp_path, os.environ.get("CC", "cc"))
    assert first is not None
    stamp = first.path.stat().st_mtime_ns
    second = exact_kernels.build(tmp_path, os.environ.get("CC", "cc"))
    assert second is not None and second.path == first.path
    assert first.path.stat().st_mtime_ns == stamp
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".lock", ".so"]


def test_bad_arguments_are_refused() -> None:
    kernels = fused_kernels()
    if kernels is None:
        pytest.skip("no kernels here")
    peaks = torch.empty(1, dtype=torch.int32)
    with pytest.raises(ValueError):
        kernels.peaks([torch.zeros(BLOCK, dtype=torch.float64)], BLOCK, peaks)
    with pytest.raises(ValueError):
        kernels.exponents(peaks, torch.empty(2, dtype=torch.int32))
    with pytest.raises(ValueError):
        kernels.accumulate(torch.zeros(BLOCK), [torch.zeros(BLOCK)], torch.ones(1), (0, 1), BLOCK)
    with pytest.raises(ValueError):
        acc = torch.zeros(BLOCK, dtype=torch.int32)
        kernels.accumulate(acc, [torch.zeros(BLOCK)], torch.ones(1), (1, BLOCK), BLOCK)


@pytest.fixture
def fresh_kernel_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A process whose kernels are not loaded yet, building into ``tmp_path``."""
    monkeypatch.setenv("PERDURE_CACHE_DIR", str(tmp_path))
    exact_kernels.load.cache_clear()
    fused_kernels.cache_clear()
    yield tmp_path / "kernels"
    exact_kernels.load.cache_clear()
    fused_kernels.cache_clear()


@needs_cc
def test_preflight_of_an_exact_run_builds_the_kernels_before_any_worker_starts(
    small_dataset: Path, fresh_kernel_cache: Path
) -> None:
    report = preflight(small_config(small_dataset, train={"reduction": "exact"}))
    assert [p.suffix for p in fresh_kernel_cache.glob("*.so")] == [".so"]
    assert not any("fused kernels" in n for n in report.notes)


def test_preflight_notes_when_the_workers_will_use_the_torch_ops(
    small_dataset: Path, fresh_kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(exact_kernels.ENV_SWITCH, "0")
    report = preflight(small_config(small_dataset, train={"reduction": "exact"}))
    assert any("fused kernels are off or cannot be built" in n for n in report.notes)
    assert not fresh_kernel_cache.exists()
