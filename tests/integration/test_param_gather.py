"""Parameters sharded at rest and gathered while a slot runs (``runtime/replica/param_gather.py``):
the gradients are the whole replica's, bit for bit, and a rank holds about 1/k of them."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Any

import pytest
import torch

from perdure.runtime.replica.param_gather import ParamGather
from perdure.runtime.shard_plan import owners
from tests.gloo_support import run_ranks

SLOTS = 3


def _task(name: str) -> Any:
    """tiny_lm (``nn.TransformerEncoderLayer``, a head tied through ``.T``) or hf_lm (a
    ``transformers`` GPT-2: ``Conv1D``'s ``addmm``, a head tied by sharing the Parameter)."""
    torch.manual_seed(7)
    mod = importlib.import_module(f"examples.{name}.task")
    return mod.make_task(d_model=32, n_layers=2, n_heads=4, max_len=32, dropout=0.1)


def _slot_grads(task: Any, slot: int, gather: ParamGather | None) -> list[bytes]:
    model, loss_fn = task.model, task.loss_fn
    g = torch.Generator().manual_seed(100 + slot)
    tokens = torch.randint(0, 256, (2, 17), generator=g)
    batch = {"tokens": tokens, "weight": torch.ones(2)}
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1000 + slot)  # dropout's masks: the same on every rank
    with gather.active(model) if gather is not None else contextlib.nullcontext():
        loss_fn(model, batch).backward()
    return [p.grad.numpy().tobytes() for p in model.parameters()]


def _rank(
    name: str, unit_bytes: int | None, prefetch: bool, rank: int, world: int, port: int, q: Any
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    task = _task(name)
    params = list(task.model.parameters())
    owner = owners([p.numel() for p in params], world)
    launch = (lambda t, src: dist.broadcast(t, src, async_op=True).wait) if prefetch else None
    gather = ParamGather(
        params,
        owner,
        rank,
        lambda t, src: dist.broadcast(t, src),
        unit_bytes=unit_bytes,
        launch=launch,
    )
    at_rest = gather.held
    grads = [_slot_grads(task, s, gather) for s in range(SLOTS)]
    foreign_freed = all(
        p.untyped_storage().nbytes() == 0 for i, p in enumerate(params) if owner[i] != rank
    )
    per_slot = gather.gathers / SLOTS
    landed = not gather.flying and (gather.prefetched > 0) == prefetch
    freed = foreign_freed and landed
    q.put((rank, grads, at_rest, gather.peak_bytes, gather.held, freed, per_slot))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("name", "k", "unit_bytes", "prefetch"),
    [
        ("tiny_lm", 2, None, True),
        ("tiny_lm", 3, None, False),
        ("hf_lm", 2, None, True),
        ("tiny_lm", 2, 1 << 30, False),
    ],
)
def test_gathered_gradients_equal_the_whole_replica_bit_for_bit(
    name: str, k: int, unit_bytes: int | None, prefetch: bool
) -> None:
    """The default units (a quarter of a shard's share), and the whole model as one unit
    (every gather a bulk one: the forward's two broadcasts, the backward's by unit); with
    the next unit prefetched (gloo's asynchronous broadcasts) or each gathered at use."""
    torch.set_num_threads(1)
    task = _task(name)
    want = [_slot_grads(task, s, None) for s in range(SLOTS)]
    total = sum(p.numel() * p.element_size() for p in task.model.parameters())
    ranks = functools.partial(_rank, name, unit_bytes, prefetch)
    out = sorted(run_ranks(ranks, k, k), key=lambda r: r[0])
    n = len(list(task.model.parameters()))
    for rank, grads, at_rest, peak, held, freed, per_slot in out:
        assert grads == want, f"rank {rank} of {k}"
        assert unit_bytes is None or per_slot < n / 2, (per_slot, n)  # one unit: few
        assert at_rest == held < total / k * 1.6, (rank, at_rest, total)
        assert peak < (total if unit_bytes is None else 2 * total), (rank, peak, total)
        assert freed


def test_a_parameter_at_rest_has_no_storage_and_keeps_its_shape() -> None:
    model = torch.nn.Linear(4, 3)
    sent: list[int] = []
    gather = ParamGather(list(model.parameters()), [1, 0], 0, lambda t, src: sent.append(src))
    assert model.weight.untyped_storage().nbytes() == 0
    assert model.weight.shape == (3, 4)
    assert model.bias.untyped_storage().nbytes() == 3 * 4
    gather.gather(0)
    assert model.weight.untyped_storage().nbytes() == 48 and sent == [1]
    gather.gather(0)  # resident: no second collective
    gather.gather(1)  # owned: sent to the group, no storage change
    assert sent == [1, 0] and gather.held == 48 + 12 == gather.peak_bytes
    gather.release()
    assert gather.held == 12 and model.weight.untyped_storage().nbytes() == 0


def test_non_contiguous_parameters_are_refused() -> None:
    p = torch.nn.Parameter(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="contiguous"):
        ParamGather([p], [0], 0, lambda t, src: None)


def test_a_failed_gather_leaves_the_parameter_at_rest() -> None:
    model = torch.nn.Linear(4, 3)

    def broken(t: torch.Tensor, src: int) -> None:
        raise RuntimeError("peer gone")

    gather = ParamGather(list(model.parameters()), [1, 1], 0, broken)
    with pytest.raises(RuntimeError, match="peer gone"):
        gather.gather(0)
    assert model.weight.untyped_storage().nbytes() == 0 and gather.held == 0
    assert not gather.live[0]


@pytest.mark.parametrize("prefetched", [False, True], ids=["gathered", "prefetched"])
def test_an_abandoned_gather_leaves_its_buffer_to_the_operation(prefetched: bool) -> None:
    """A broadcast abandoned on the wire (the epoch changed) still lands its bytes whenever
    they arrive: the parameter goes back to rest on a storage of its own, and the memory
    the operation holds stays valid for its late write (resized to zero, it was freed
    under gloo: a survivor's glibc abort in a clean-clone CI)."""
    model = torch.nn.Linear(4, 3)
    on_wire: list[torch.Tensor] = []

    def abandoned(t: torch.Tensor, src: int) -> None:
        on_wire.append(t)  # what the backend's operation keeps until it ends
        raise RuntimeError("membership epoch changed during a collective")

    def launch(t: torch.Tensor, src: int) -> Any:
        on_wire.append(t)
        return functools.partial(abandoned, t, src)

    params = list(model.parameters())
    gather = ParamGather(params, [1, 1], 0, abandoned, launch=launch if prefetched else None)
    with pytest.raises(RuntimeError, match="epoch changed"):
        if prefetched:
            gather.prefetch([0])
            gather.gather(0)
        else:
            gather.gather(0)
    gather.release()
    assert model.weight.untyped_storage().nbytes() == 0 and model.weight.shape == (3, 4)
    assert not gather.live[0] and gather.held == 0
    late = on_wire[0]
    assert late.untyped_storage().nbytes() == 48  # still the operation's
    gather.broadcast = lambda t, src: t.fill_(1)  # the next epoch's gather succeeds
    gather.launch = None
    gather.gather(0)
    late.fill_(7)  # the abandoned one's bytes land late: not in the parameter
    assert bool((model.weight.detach().view(torch.uint8) == 1).all())


def test_a_parameter_hashed_or_written_stays_resizable() -> None:
    """The fingerprint and the checkpoint's byte views go through ctypes: a storage
    exported to numpy can never be resized again, and freeing one at rest resizes it."""
    from perdure.checkpoint.tensors import byte_view

    p = torch.nn.Parameter(torch.arange(6.0))
    view = byte_view(p.detach())
    assert bytes(view) == p.detach().numpy().copy().tobytes()
    q = torch.nn.Parameter(torch.arange(6.0))
    byte_view(q.detach())
    q.untyped_storage().resize_(0)
    assert q.untyped_storage().nbytes() == 0 and q.shape == (6,)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_unit_is_gathered_with_one_broadcast_per_owner() -> None:
    """Owners alternate (weights 0, biases 1): the whole MLP is one unit under a large
    budget, so its forward gathers it in two broadcasts, not four (each parameter at a
    64-byte aligned offset of the buffer, which the received ones then view); the
    backward's gathers come by unit too, and the gradients are the whole model's."""
    model = _mlp()
    x = torch.ones(3, 4)
    model(x).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    want = [p.detach().clone() for p in model.parameters()]
    sent: list[tuple[int, int]] = []

    def broadcast(t: torch.Tensor, src: int) -> None:  # owner 1's bytes, as a peer sends
        sent.append((src, t.numel()))
        if src == 1:  # the biases: 32 bytes at 0, 8 bytes at 64
            t[:32].copy_(want[1].view(-1).view(torch.uint8))
            t[64:72].copy_(want[3].view(-1).view(torch.uint8))

    gather = ParamGather(list(model.parameters()), [0, 1, 0, 1], 0, broadcast, unit_bytes=1 << 20)
    for p in model.parameters():
        p.grad = None
    with gather.active(model):
        model(x).sum().backward()
    assert sent[:2] == [(0, 128 + 64), (1, 64 + 64)]
    assert gather.gathers == len(sent) < 2 * 4
    got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want_grads, strict=True))
    assert model[0].bias.untyped_storage().nbytes() == 0  # at rest again, in its own storage
    assert model[0].bias.shape == (8,) and gather.held == (32 + 16) * 4


def test_units_are_the_largest_modules_within_the_budget() -> None:
    model = _mlp()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    nbytes = [p.numel() * 4 for p in params]
    from perdure.runtime.replica.param_gather import units

    assert [idx for _, idx in units(model, index, nbytes, 1 << 20)] == [[0, 1, 2, 3]]
    cut = units(model, index, nbytes, 200)  # the first Linear is 160 bytes, the second 72
    assert [(m, idx) for m, idx in cut] == [(model[0], [0, 1]), (model[2], [2, 3])]
    assert [idx for _, idx in units(model, index, nbytes, 0)] == [[0, 1], [2, 3]]  # own ones


def test_reading_a_parameters_metadata_or_grad_does_not_gather_it() -> None:
    """The slot engine clears and reads ``.grad`` inside the slot (the ``grad`` getter and
    setter are torch functions too): that gathered the whole model at every slot's start
    until metadata reads were told apart."""
    model = torch.nn.Linear(4, 3)
    sent: list[int] = []
    gather = ParamGather(list(model.parameters()), [1, 1], 0, lambda t, src: sent.append(src))
    with gather.active(model):
        for p in model.parameters():
            p.grad = None
            assert p.grad is None and p.numel() > 0 and p.shape and p.requires_grad
        assert sent == []
        model.weight.sum()  # a read of the bytes does
        assert sent == [1]


def test_a_units_forward_starts_the_next_units_broadcast_before_that_unit_runs() -> None:
    """Prefetch: the second Linear's broadcast is launched inside the first one's
    pre-hook and waited for only at its own; the backward's gathers prefetch the unit
    before; the gradients are the whole model's and every flight lands by the slot's end."""
    model = _mlp()
    x = torch.ones(3, 4, requires_grad=True)  # so the backward needs the first weight too
    model(x).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    want = [p.detach().clone() for p in model.parameters()]
    log: list[tuple[str, int]] = []

    def fill(t: torch.Tensor, src: int) -> None:  # owner 1's bytes, as a peer sends them
        w, b = (want[i].view(-1).view(torch.uint8) for i in (2, 3))
        if src == 1 and t.numel() == 128:  # its unit: the weight at 0, the bias at 64
            t[:64].copy_(w)
            t[64:72].copy_(b)
        elif src == 1:
            t.copy_(w if t.numel() == 64 else b)

    def launch(t: torch.Tensor, src: int) -> Any:
        log.append(("launch", src))

        def wait() -> None:
            log.append(("wait", src))
            fill(t, src)

        return wait

    def now(t: torch.Tensor, src: int) -> None:
        log.append(("now", src))
        fill(t, src)

    params = list(model.parameters())
    gather = ParamGather(params, [0, 0, 1, 1], 0, now, unit_bytes=0, launch=launch)
    for p in params:
        p.grad = None
    with gather.active(model):
        model(x).sum().backward()
        assert not gather.flying
    # unit 0 (its own) gathered, unit 1's launched at once and landed at its own hook
    assert log[:3] == [("now", 0), ("launch", 1), ("wait", 1)]
    # the backward: unit 1 gathered again, and unit 0 (the one before) prefetched there
    assert log[3:6] == [("now", 1), ("launch", 0), ("wait", 0)], log
    assert gather.prefetched == 2
    got = [p.grad for p in params]
    assert all(torch.equal(a, b) for a, b in zip(got, want_grads, strict=True))
    assert params[2].untyped_storage().nbytes() == 0 and gather.held == (32 + 8) * 4
