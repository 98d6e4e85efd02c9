"""Shared builders for the checkpoint tests: small states with every awkward dtype."""

from __future__ import annotations

import json
import random
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from perdure.checkpoint import CheckpointState, capture_rng, save_checkpoint
from perdure.checkpoint.compare import same_bits  # one definition of bitwise equality
from perdure.checkpoint.manifest import SEAL_KEY, encode_manifest


def trained_model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model after two Adam steps, so that the optimizer has real state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
    return model, opt


def awkward_tensors() -> dict[str, torch.Tensor]:
    """fp32, bf16, int64, empty and 0-d tensors, plus a non-contiguous one."""
    g = torch.Generator().manual_seed(7)
    return {
        "w32": torch.randn(6, 5, generator=g),
        "wbf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
        "empty": torch.empty(0, 4),
        "empty1d": torch.empty(0, dtype=torch.int64),
        "scalar": torch.tensor(3.25),
        "scalar_i": torch.tensor(-2, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "half": torch.randn(7, generator=g).half(),
        "transposed": torch.randn(3, 9, generator=g).t(),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def make_state(step: int = 1200, seed: int = 0, extra: bool = True) -> CheckpointState:
    model, opt = trained_model_and_optimizer(seed)
    random.seed(seed)
    np.random.seed(seed)
    sd = model.state_dict()
    if extra:
        sd.update(awkward_tensors())
    return CheckpointState(
        step=step,
        model=sd,
        optimizer=opt.state_dict(),
        rng=capture_rng(seed),
        data={
            "dataset": "ds-abc123",
            "epoch": 2,
            "step": step,
            "cursor": 4096,
            "quarantine": [3, 9],
        },
        config_hash="sha256:" + "ab" * 32,
        canonical_config={"optim": {"lr": 0.001, "betas": (0.9, 0.99)}, "train": {"seed": seed}},
        topology={
            "regions": ["eu", "us"],
            "workers": 3,
            "membership_epoch": 4,
            "slots": {0: [0, 1]},
        },
        provenance={"sha": "deadbeef", "dirty": False, "versions": {"torch": torch.__version__}},
        decisions=[
            {"step": 10, "kind": "quarantine", "details": {"shard": 3, "why": float("nan")}}
        ],
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StoreExchange:
    """A test all-gather over a TCPStore: each rank sets ``<round>/<rank>``, waits for all."""

    def __init__(self, port: int, rank: int, world: int) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore(
            "127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=30)
        )
        self.rank, self.world = rank, world

    def __call__(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        r = payload["round"]
        self.store.set(f"{r}/{self.rank}", json.dumps(payload))
        keys = [f"{r}/{i}" for i in range(self.world)]
        self.store.wait(keys)
        return [json.loads(self.store.get(k)) for k in keys]

    def close(self) -> None:
        """A last barrier: the rank hosting the store leaves only after every rank has
        read its last round (else their final ``get`` meets a closed connection)."""
        self.store.set(f"done/{self.rank}", "1")
        if self.rank == 0:
            self.store.wait([f"done/{i}" for i in range(self.world)])


def same_tree(a: Any, b: Any) -> bool:
    """Structural equality with tensors compared bitwise and NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, str):  # str subclasses (torch.__version__) come back as str
        return isinstance(b, str) and a == b
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    return type(a) is type(b) and a == b


def rewrite_manifest(
    path: Path, edit: Callable[[dict[str, Any]], object], *, seal: bool = True
) -> None:
    """Apply ``edit`` to the manifest of checkpoint ``path`` and write it back, resealed
    (as a writer would, so that only the structural rules stand in the way) or, with
    ``seal=False``, as plain JSON without a seal."""
    mpath = path / "manifest.json"
    m = json.loads(mpath.read_bytes())
    m.pop(SEAL_KEY, None)
    edit(m)
    mpath.write_bytes(encode_manifest(m) if seal else json.dumps(m).encode())


class ThreadExchange:
    """An in-process all-gather for W writer threads: a parallel save without processes
    (the part files, manifest and commit are exactly those of W processes)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.cond = threading.Condition()
        self.rounds: dict[str, dict[int, dict[str, Any]]] = {}

    def __call__(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        r = payload["round"]
        with self.cond:
            got = self.rounds.setdefault(r, {})
            got[payload["rank"]] = payload
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(got) == self.world, timeout=30):
                raise TimeoutError(f"exchange round {r}: {len(got)} of {self.world} ranks")
            return [got[i] for i in range(self.world)]


def save_split(root: Path, state: CheckpointState, world: int) -> Path:
    """Save ``state`` as ``world`` writers would (one part file each, split tensors)."""
    exchange = ThreadExchange(world)
    paths: list[Path] = []
    errors: list[BaseException] = []

    def write(rank: int) -> None:
        try:
            paths.append(save_checkpoint(root, state, rank=rank, world=world, exchange=exchange))
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=write, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return paths[0]
