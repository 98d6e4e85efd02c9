"""Replica groups on real gloo process groups: four ranks in two groups of two update the
parameters they own, exchange them, move shards at an epoch change, and end with the
parameters and the optimizer state of one unsharded replica, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from perdure.checkpoint import state_digest
from perdure.runtime.comm.group import Comm
from perdure.runtime.member.shard_group import Shards, optimizer_params
from perdure.runtime.shard_plan import ALL, group_of, shard_of

WORLD, K, FIRST, THEN = 4, 2, 3, 2
T = timedelta(seconds=30)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Linear(8, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _grads(model: nn.Module, step: int) -> None:
    """The step's summed gradient, as every rank holds it after the reduction; clipped."""
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 3
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)


def _reference() -> str:
    model, opt = _model()
    for step in range(FIRST + THEN):
        _grads(model, step)
        opt.step()
    return state_digest(model.state_dict(), opt.state_dict())


def _epoch(store: dist.Store, name: str, rank: int, model: nn.Module, opt: Any) -> Shards:
    comm = Comm(store, f"{name}/", rank, WORLD, T, lambda: False)
    group = comm.subgroup(store, f"shard{group_of(rank, K)}", shard_of(rank, K), K)
    shards = Shards(optimizer_params(opt), k=K, rank=rank, group=group, timeout=T)
    shards.epoch = comm  # type: ignore[attr-defined]
    return shards


def _steps(shards: Shards, model: nn.Module, opt: Any, steps: range) -> None:
    for step in steps:
        _grads(model, step)
        shards.drop_foreign_grads()
        opt.step()
        shards.sync_params()


def _rank(proc: int, port: int, q: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, proc == 0, T)
    model, opt = _model()
    shards = _epoch(store, "e1", proc, model, opt)  # rank = process
    state, params = shards.exchange(shards.epoch, ALL, opt.state_dict())  # type: ignore[attr-defined]
    assert state is not None and params == {}  # the parameters are whole: none travel
    opt.load_state_dict(state)
    _steps(shards, model, opt, range(FIRST))
    owned = sorted(opt.state_dict()["state"])
    # An epoch change moves every member one place down: each must hold the other shard.
    rank = (proc + 1) % WORLD
    held = shards.mine
    shards = _epoch(store, "e2", rank, model, opt)
    state, params = shards.exchange(shards.epoch, held, opt.state_dict())  # type: ignore[attr-defined]
    assert state is not None and params == {}
    opt.load_state_dict(state)
    _steps(shards, model, opt, range(FIRST, FIRST + THEN))
    whole = shards.skeleton(opt.state_dict())
    digest = state_digest(model.state_dict(), whole, fetch=shards.fetcher(whole))
    q.put((proc, owned, shards.owner, digest))


def test_two_groups_of_two_end_with_the_unsharded_replicas_bits_and_hold_half_the_state() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = {proc: rest for proc, *rest in (q.get(timeout=90) for _ in range(WORLD))}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    want = _reference()
    for proc, (owned, owner, digest) in sorted(got.items()):
        assert digest == want, proc  # parameters and the whole optimizer state
        assert owned == [i for i, o in enumerate(owner) if o == proc % K]  # only its shard
    assert sorted(got[0][0] + got[1][0]) == list(range(len(got[0][1])))  # between them, all
