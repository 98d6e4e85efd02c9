"""int8 DiLoCo's outer reduction (``comm/int8_gather.py``): a replica's record is a
quarter of the exact reduction's 32-bit integers plus its exponents, index and tail, and
the gathered sum is the same bits whichever member hosted which replica."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.int8_gather import Int8Gather, compress, gather_compressed, inflate
from perdure.runtime.replica.layout import GradLayout
from perdure.runtime.replica.outer import decode_int8, ef21_encode, ef21_update, encode_int8
from tests.gloo_support import run_threads

P, R, M, BLOCK = 10_000, 4, 1, 256
LAYOUT = GradLayout(numel=P, slots=R, metrics=M)
TIMEOUT = timedelta(seconds=30)


def _replicas() -> list[torch.Tensor]:
    """R slot buffers: replica r's pseudo-gradient (spread over 12 binary orders of
    magnitude), its flag, loss and metric in its own slot's entries."""
    g = torch.Generator().manual_seed(7)
    bufs = []
    for r in range(R):
        buf = LAYOUT.new_buffer()
        scale = torch.pow(2.0, torch.randint(-12, 0, (P,), generator=g).float())
        LAYOUT.grads(buf).copy_(torch.randn(P, generator=g) * scale)
        LAYOUT.losses(buf)[r] = 2.5 + r / 4
        LAYOUT.user_metrics(buf)[0, r] = 10.0 + r
        bufs.append(buf)
    return bufs


def _reduce(hosts: list[list[int]], bufs: list[torch.Tensor]) -> torch.Tensor:
    gather = Int8Gather(LAYOUT, BLOCK)
    width = max(len(h) for h in hosts)
    payloads = [gather.pack(h, [bufs[r] for r in h], width) for h in hosts]
    return gather.total(payloads, R)[0]


def test_a_records_payload_is_a_quarter_of_the_exact_reductions_plus_its_index_and_tail() -> None:
    gather = Int8Gather(LAYOUT, BLOCK)
    blocks = -(-P // BLOCK)
    assert gather.record_bytes == P + blocks + 4 + 4 * (2 + M) == 10_000 + 40 + 4 + 12
    payload = gather.pack([2], [_replicas()[2]], 1)
    assert payload.dtype == torch.uint8 and payload.numel() == gather.payload_bytes(1)
    # the exact reduction (reduction_bits = 32): an int32 per value, one per block's maximum
    exact = 4 * LAYOUT.size + 4 * blocks
    assert exact == 4 * (P + (2 + M) * R) + 4 * blocks
    overhead = 4 + 4 * (2 + M) - (2 + M) * R  # the index and tail, less the buffer's tail
    assert payload.numel() == exact // 4 + overhead and overhead == 4
    assert gather.payload_bytes(2) == 2 * gather.record_bytes


def test_int8_exponents_hold_every_normal_peak_and_round_subnormal_blocks_coarser() -> None:
    x = torch.tensor([3.0e38, -1.0, 2.0**-126, 2.0**-140, 2.0**-149, 0.0])
    q, e = encode_int8(x, 2)
    assert e.dtype == torch.int8 and (e.int() + 1).tolist() == [128, -125, -127]
    # 3e38 = 0.88 * 2**128: step 2**121, q = 113; -1.0 rounds to 0 beside it
    assert decode_int8(q, e, 2)[:3].tolist() == [113 * 2.0**121, 0.0, 2.0**-126]
    assert decode_int8(q, e, 2)[3:].tolist() == [0.0, 0.0, 0.0]  # below 2**-135: zero


def test_the_gathered_sum_is_the_same_bits_whoever_hosts_which_replica() -> None:
    bufs = _replicas()
    one = _reduce([[0, 1, 2, 3]], bufs)
    for hosts in ([[0, 2], [1, 3]], [[3], [0], [2], [1]], [[1, 2, 3], [0]]):
        assert torch.equal(_reduce(hosts, bufs), one), hosts
    want = torch.zeros(P, dtype=torch.float64)
    for r in range(R):  # the decoded replicas added in replica order, in float64
        q, e = encode_int8(LAYOUT.grads(bufs[r]), BLOCK)
        want += decode_int8(q, e, BLOCK)
    assert torch.equal(LAYOUT.grads(one), want.float())
    assert LAYOUT.losses(one).tolist() == [2.5 + r / 4 for r in range(R)]
    assert LAYOUT.user_metrics(one)[0].tolist() == [10.0, 11.0, 12.0, 13.0]
    assert LAYOUT.flags(one).tolist() == [0.0] * R
    err = (LAYOUT.grads(one) - sum(LAYOUT.grads(b) for b in bufs)).abs().max()
    assert 0 < err < 2**-7 * 4 * LAYOUT.grads(torch.stack(bufs)).abs().max()


def test_a_replica_missing_or_sent_twice_is_refused_naming_it() -> None:
    bufs = _replicas()
    with pytest.raises(RuntimeError, match=r"replicas \[3\] missing"):
        _reduce([[0, 1], [2]], bufs)
    with pytest.raises(RuntimeError, match="replica 1 sent twice"):
        _reduce([[0, 1], [1, 2, 3]], bufs)


def test_with_error_feedback_every_member_makes_the_same_new_estimates_from_the_records() -> None:
    """Records of ``delta_r - g_r``: the new estimates ``g_r + decoded`` and their sum
    are the same bits whoever hosts which replica, and are what the pure functions give."""
    bufs, gather = _replicas(), Int8Gather(LAYOUT, BLOCK)
    g = torch.Generator().manual_seed(11)
    estimates = torch.randn(R, P, generator=g) * 2.0**-6
    results = []
    for hosts in ([[0, 1, 2, 3]], [[0, 2], [1, 3]], [[3], [0], [2], [1]]):
        width = max(len(h) for h in hosts)
        payloads = [gather.pack(h, [bufs[r] for r in h], width, estimates) for h in hosts]
        results.append(gather.total(payloads, R, estimates))
    (one, new), *rest = results
    assert new is not None
    assert all(torch.equal(t, one) and n is not None and torch.equal(n, new) for t, n in rest)
    want_sum = torch.zeros(P, dtype=torch.float64)
    for r in range(R):
        q, e = ef21_encode(LAYOUT.grads(bufs[r]), estimates[r], BLOCK)
        assert torch.equal(new[r], ef21_update(estimates[r], q, e, BLOCK))
        want_sum += new[r].double()
    assert torch.equal(LAYOUT.grads(one), want_sum.float())
    assert LAYOUT.losses(one).tolist() == [2.5 + r / 4 for r in range(R)]
    plain = _reduce([[0, 1, 2, 3]], bufs)
    assert not torch.equal(LAYOUT.grads(one), LAYOUT.grads(plain))  # another math


# -- the compressed wire (outer.wire_compression = "zlib") ----------------------------------


def test_compressed_records_inflate_to_the_same_bytes_and_are_smaller() -> None:
    gather = Int8Gather(LAYOUT, BLOCK)
    bufs = _replicas()
    full = gather.pack([0, 1], bufs[:2], 2)
    sparse = gather.pack([3], [bufs[3]], 2)  # one unused record of zeros
    for raw in (full, sparse):
        packed = compress(raw)
        assert torch.equal(inflate(packed, raw.numel(), 0), raw)
    assert compress(full).numel() < 0.95 * full.numel()
    assert compress(sparse).numel() < 0.6 * sparse.numel()  # the unused record: ~nothing


def test_a_payload_that_inflates_to_another_size_or_not_at_all_is_refused() -> None:
    raw = Int8Gather(LAYOUT, BLOCK).pack([0], [_replicas()[0]], 1)
    packed = compress(raw)
    assert raw.numel() == 10_056
    with pytest.raises(RuntimeError, match="member 2's records inflate to more than the plan's"):
        inflate(packed, raw.numel() - 1, 2)  # a bomb's way: more than the plan's size
    with pytest.raises(RuntimeError, match="inflate to 10056 bytes, not the plan's 10057"):
        inflate(packed, raw.numel() + 1, 2)
    with pytest.raises(RuntimeError, match="inflate to 0 bytes, not the plan's 10056"):
        inflate(packed[:8], raw.numel(), 2)  # cut short
    with pytest.raises(RuntimeError, match="member 1's records do not inflate"):
        inflate(torch.full((64,), 7, dtype=torch.uint8), raw.numel(), 1)
    trailing = torch.cat([packed, torch.zeros(3, dtype=torch.uint8)])
    with pytest.raises(RuntimeError, match="trailing bytes"):
        inflate(trailing, raw.numel(), 0)


def test_members_of_different_compressed_sizes_gather_every_members_records() -> None:
    """Three members in threads over gloo: 2, 1 and 0 replicas each (so three compressed
    sizes); every member gets every member's records, bit for bit, and the same sum."""
    gather = Int8Gather(LAYOUT, BLOCK, compress=True)
    bufs = _replicas()
    hosts = [[0, 1], [2, 3], []]
    width = 2
    raws = [gather.pack(h, [bufs[r] for r in h], width) for h in hosts]
    store = dist.HashStore()

    def member(rank: int) -> list[torch.Tensor]:
        comm = Comm(store, "z", rank, len(hosts), TIMEOUT, lambda: False)
        return gather_compressed(comm, raws[rank], TIMEOUT)

    got = run_threads(member, len(hosts))
    for rank in range(len(hosts)):
        assert [torch.equal(a, b) for a, b in zip(got[rank], raws, strict=True)] == [True] * 3
    assert torch.equal(gather.total(got[2], R)[0], _reduce([[0, 1], [2, 3]], bufs))
