"""The swarm state copy (``runtime/comm/swarm.py``): a receiver fetches disjoint ranges from
every holder at once, bit for bit; a range that fails its checksum is fetched again from
another holder; a peer's malformed structure or bytes end the copy with a clear error on
every rank, never a crash."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from perdure.runtime.comm import swarm
from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.swarm import (
    CopyJob,
    Offer,
    Received,
    StateCopyFailed,
    SwarmCopy,
    _plan,
    _template,
)

T = timedelta(seconds=30)
_SEEDED = threading.Lock()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.LayerNorm(96), nn.Linear(96, 8))


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A holder's replica: two AdamW steps from seed 0 (the same bits in every holder)."""
    m = _model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for i in range(2):
        torch.manual_seed(100 + i)
        m(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


EXTRA = {"next_step": 2, "data": {"cursor": 7}, "decisions": [], "held": -1}


def _layout(m: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in m.state_dict(keep_vars=True).items()}


def _target(m: nn.Module) -> Any:
    named = m.state_dict(keep_vars=True)

    def target(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if key.startswith("model/"):
            return named[key[len("model/") :]].detach()
        return torch.empty(shape, dtype=dtype)

    return target


def _run(
    world: int, receivers: tuple[int, ...], copier: Any, strided: bool = False
) -> dict[int, Any]:
    """Every rank in a thread over one gloo group: holders offer the trained replica, the
    receivers a fresh model's storage. Returns each rank's result or exception."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out: dict[int, Any] = {}

    def rank(r: int) -> None:
        store = torch.distributed.TCPStore("127.0.0.1", port, world, r == 0, T)
        comm = Comm(store, "copy/", r, world, T, lambda: False, bind="127.0.0.1")
        try:
            holder = r not in receivers
            with _SEEDED:  # torch's generator is one per process: the threads take turns
                m, opt = _trained() if holder else (_model(r + 1), None)
            if strided and not holder:  # the same values, laid out transposed
                w = m[0].weight.detach()
                m[0].weight = nn.Parameter(w.t().contiguous().t())
            job = CopyJob(
                receivers=receivers,
                source=0,
                shard_degree=1,
                layout=_layout(m),
                offer=(m.state_dict(), opt.state_dict(), EXTRA) if opt is not None else None,
                target=None if holder else _target(m),
                timeout=T,
            )
            c = copier(r) if callable(copier) else copier
            got = c.copy(comm, job)
            out[r] = (got, m, dict(c.stats))
        except Exception as e:
            out[r] = e
        finally:
            comm.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == world, f"ranks that did not finish: {set(range(world)) - set(out)}"
    return out


def _assert_same_as_holders(got: Received, m: nn.Module) -> None:
    ref, opt = _trained()
    for name, t in ref.state_dict().items():
        assert torch.equal(m.state_dict()[name], t), name
        assert got.model[name].data_ptr() == m.state_dict()[name].data_ptr(), name
    want = opt.state_dict()["state"]
    have = got.optimizer["state"]
    assert sorted(have) == sorted(want)
    for i, s in want.items():
        for k, v in s.items():
            assert torch.equal(have[i][k], v) and have[i][k].dtype == v.dtype, (i, k)
    assert got.optimizer["param_groups"] == opt.state_dict()["param_groups"]
    assert got.extra == EXTRA


def test_a_joiner_fetches_disjoint_ranges_from_every_holder_into_its_own_tensors() -> None:
    out = _run(4, (3,), lambda r: SwarmCopy(chunk_bytes=1000, window=5))
    got, m, stats = out[3]
    assert isinstance(got, Received)
    _assert_same_as_holders(got, m)
    assert got.holders == [0, 1, 2] and got.refetched == 0 and got.template == 0
    sent = [out[r][2]["bytes_sent"] for r in (0, 1, 2)]
    assert sum(sent) == got.nbytes and min(sent) > 0.3 * got.nbytes / 3
    assert stats["ranges_received"] == sum(out[r][2]["ranges_sent"] for r in (0, 1, 2))
    assert all(out[r][0] is None for r in (0, 1, 2))


def test_two_receivers_fetch_from_three_holders_at_once_without_a_cycle_of_waits() -> None:
    """Five ranks, receivers 1 and 3 between holders 0, 2 and 4, a window of 2: every
    holder serves both receivers, each gets the holders' bits; the load is spread."""
    out = _run(5, (1, 3), lambda r: SwarmCopy(chunk_bytes=700, window=2))
    for r in (1, 3):
        got, m, _ = out[r]
        _assert_same_as_holders(got, m)
        assert got.holders == [0, 2, 4]
    sent = [out[r][2]["bytes_sent"] for r in (0, 2, 4)]
    assert sum(sent) == 2 * out[1][0].nbytes and min(sent) > 0.8 * max(sent)


def test_a_receivers_non_contiguous_tensor_is_filled_once_its_ranges_are_in() -> None:
    """A receiver's own tensor may be a strided view (a transposed weight): its ranges land
    in a contiguous stand-in, copied in once complete; the bits are the holders'."""

    def copier(r: int) -> SwarmCopy:
        return SwarmCopy(chunk_bytes=1000)

    out = _run(2, (1,), copier, strided=True)
    got, m, _ = out[1]
    assert not m[0].weight.is_contiguous()
    _assert_same_as_holders(got, m)


class _Corrupt(SwarmCopy):
    """Flips one byte of every ``every``-th range it sends (on the wire, not its state)."""

    def __init__(self, every: int, bundle: int = 0) -> None:
        super().__init__(chunk_bytes=1000, window=3, bundle_bytes=bundle)
        self.every, self.n = every, 0

    def _outgoing(self, data: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n % self.every:
            return data
        bad = data.clone()
        bad[0] ^= 0xFF
        return bad


def test_a_range_that_fails_its_checksum_is_fetched_again_from_another_holder() -> None:
    def copier(r: int) -> SwarmCopy:  # every range a message of its own
        return _Corrupt(every=10) if r == 1 else SwarmCopy(chunk_bytes=1000, bundle_bytes=0)

    out = _run(3, (2,), copier)
    got, m, _ = out[2]
    assert isinstance(got, Received)
    _assert_same_as_holders(got, m)  # the corrupted bytes were overwritten
    corrupted = out[1][2]["ranges_sent"] // 10
    assert corrupted > 0 and got.refetched == corrupted


def test_a_range_that_fails_from_every_holder_is_a_clear_failure_on_every_rank() -> None:
    out = _run(2, (1,), lambda r: _Corrupt(every=1))
    for r in (0, 1):
        assert isinstance(out[r], StateCopyFailed), out[r]
        assert "failed their XXH3-64 from every holder that offers them ([0])" in str(out[r])


class _Claims(SwarmCopy):
    """A receiver that reports more failed ranges than the copy has (a hostile peer)."""

    def _round(self, *args: Any) -> list[int]:
        super()._round(*args)
        return list(range(10**6))


def test_a_peer_claiming_more_failed_ranges_than_the_copy_has_fails_it_on_every_rank() -> None:
    out = _run(3, (2,), lambda r: _Claims() if r == 2 else SwarmCopy())
    for r in range(3):
        assert isinstance(out[r], StateCopyFailed), out[r]
        assert "a rank reports 1000000 failed ranges of the copy's" in str(out[r])


class _Offers(SwarmCopy):
    """Offers a structure of its own instead of its state's."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(chunk_bytes=1000)
        self.raw = raw

    def _encode(self, offer: Any) -> tuple[dict[str, torch.Tensor], bytes]:
        tensors, _ = super()._encode(offer)
        return tensors, self.raw


def test_a_holder_offering_garbage_is_left_out_and_the_others_serve() -> None:
    out = _run(
        3,
        (2,),
        lambda r: (
            _Offers(b'{"tensors": [["x", [-1], "F32"]]}') if r == 1 else SwarmCopy(chunk_bytes=1000)
        ),
    )
    got, m, _ = out[2]
    assert isinstance(got, Received)
    _assert_same_as_holders(got, m)
    assert got.holders == [0] and out[1][2]["ranges_sent"] == 0


def test_an_offer_longer_than_the_head_arrives_whole_in_a_second_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(swarm, "HEAD_BYTES", 256)  # every holder's offer spills over
    out = _run(3, (2,), lambda r: SwarmCopy(chunk_bytes=1000))
    got, m, _ = out[2]
    assert isinstance(got, Received)
    _assert_same_as_holders(got, m)
    assert got.holders == [0, 1]


def test_an_offer_over_the_limit_refuses_the_copy_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(swarm, "MAX_OFFER_BYTES", 100)
    out = _run(3, (2,), lambda r: SwarmCopy())
    for r in range(3):
        assert isinstance(out[r], StateCopyFailed), out[r]
        assert "(the limit is MAX_OFFER_BYTES = 100)" in str(out[r])


def _offer_json(**change: Any) -> bytes:
    import json

    m, opt = _trained()
    _, raw = SwarmCopy()._encode((m.state_dict(), opt.state_dict(), EXTRA))
    h = json.loads(raw)
    h.update(change)
    return json.dumps(h).encode()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tensors": [["model/0.weight", [96, 65], "F32"]]},
            "rank 0's offer: model/0.weight is F32 [96, 65], this model has F32 [96, 64]",
        ),
        (
            {"tensors": [["optimizer/x", [1 << 40], "F32"]]},
            "optimizer tensors of 4398046511104 bytes, more than OPTIMIZER_FACTOR",
        ),
        ({"optimizer": {"$tensor": "optimizer/none"}}, "its optimizer structure does not decode"),
        ({"extra": {"next_step": 2}}, "extra must hold 'data' (an object) and 'decisions'"),
    ],
    ids=["wrong_shape", "huge", "bad_structure", "bad_extra"],
)
def test_a_source_offering_a_structure_that_does_not_fit_refuses_the_copy_on_every_rank(
    change: dict[str, Any], message: str
) -> None:
    raw = _offer_json(**change)
    out = _run(2, (1,), lambda r: _Offers(raw) if r == 0 else SwarmCopy())
    for r in (0, 1):
        assert isinstance(out[r], StateCopyFailed), out[r]
        assert message in str(out[r])


def _offer(rank: int, held: int, keys: list[str]) -> Offer:
    tensors = {k: ((10,), "F32") for k in keys}
    extra = {"next_step": 5, "held": held, "data": {}, "decisions": []}
    return Offer(rank, tensors, {}, extra)


def test_a_sharded_joiner_copies_a_holder_of_its_own_shard_and_only_that_shard() -> None:
    """k = 2; rank 2 (shard 0) joins; ranks 1 and 3 hold shard 1, rank 0 shard 0."""
    offers = {
        0: _offer(0, 0, ["model/w", "optimizer/state/0/m"]),
        1: _offer(1, 1, ["model/w", "optimizer/state/1/m"]),
        3: _offer(3, 1, ["model/w", "optimizer/state/1/m"]),
    }
    job = CopyJob(receivers=(2,), source=1, shard_degree=2, layout={"w": ((10,), torch.float32)})
    templates = {2: _template(2, job, offers)}
    assert templates == {2: 0}
    ranges = _plan(job, offers, templates, chunk=16)
    assert [(r.key, r.lo, r.hi, r.eligible) for r in ranges] == [
        ("model/w", 0, 16, (0, 1, 3)),
        ("model/w", 16, 32, (0, 1, 3)),
        ("model/w", 32, 40, (0, 1, 3)),
        ("optimizer/state/0/m", 0, 16, (0,)),
        ("optimizer/state/0/m", 16, 32, (0,)),
        ("optimizer/state/0/m", 32, 40, (0,)),
    ]
    # the shard's ranges, which only rank 0 offers, are assigned first: the parameters'
    # then go to ranks 1 and 3, not a third of them to rank 0 on top of its shard
    assert [r.holder(0) for r in ranges] == [1, 3, 1, 0, 0, 0]
    assert [r.holder(1) for r in ranges] == [3, 0, 3, None, None, None]


def test_a_states_small_tensors_travel_as_one_message_per_holder_bit_for_bit() -> None:
    """24 ranges (6 model tensors, AdamW's step and two moments of each: 86 KB) from one
    holder: one bundle, one message; from three holders: one message each, the bytes
    still balanced by the plan; the joiner's state is the holders' bit for bit."""
    out = _run(2, (1,), lambda r: SwarmCopy())
    got, m, stats = out[1]
    _assert_same_as_holders(got, m)
    assert (out[0][2]["ranges_sent"], out[0][2]["messages_sent"]) == (24, 1)
    assert (stats["ranges_received"], stats["messages_received"]) == (24, 1)
    out = _run(4, (3,), lambda r: SwarmCopy())
    got, m, stats = out[3]
    _assert_same_as_holders(got, m)
    assert [out[r][2]["messages_sent"] for r in (0, 1, 2)] == [1, 1, 1]
    assert sum(out[r][2]["ranges_sent"] for r in (0, 1, 2)) == 24
    assert stats["messages_received"] == 3 and got.holders == [0, 1, 2]


def test_a_bundle_that_fails_its_checksum_is_fetched_again_range_by_range_elsewhere() -> None:
    """Every message holder 1 sends is corrupted on the wire: each of its ranges fails
    (one checksum for the bundle) and comes again from holder 0; the bits are right."""

    def copier(r: int) -> SwarmCopy:
        if r == 1:
            return _Corrupt(every=1, bundle=4096)
        return SwarmCopy(chunk_bytes=1000, bundle_bytes=4096)

    out = _run(3, (2,), copier)
    got, m, _ = out[2]
    assert isinstance(got, Received)
    _assert_same_as_holders(got, m)
    assert out[1][2]["messages_sent"] < out[1][2]["ranges_sent"]
    assert got.refetched == out[1][2]["ranges_sent"] > 0
