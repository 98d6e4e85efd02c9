"""Memory of a replica group's rank against an unsharded replica (``train.shard_degree``).

For k = 1, 2, 4, 8: the tiny_lm task at a larger size (``--d-model``, ``--layers``) with
its AdamW optimizer, one step taken as rank j of a group of k takes it (the real
``Shards.drop_foreign_grads``: the optimizer creates state only for the parameters the
rank owns), then the bytes each rank keeps: parameters, optimizer state, and their sum,
each as a ratio of the unsharded replica's. Also the largest rank's share (the whole-
parameter ownership balances bytes, not counts, and one big embedding can dominate).

In one process: the bytes a rank keeps do not depend on the collectives (the parameters'
exchange allocates one shard's bytes for the time of a broadcast). The issue's bar: about
1/k of parameters + optimizer state. Whole-parameter ownership keeps the parameters whole
on every rank, so the sum is (P + 2P/k) / 3P for Adam: the optimizer state is what meets 1/k.

A periodic checkpoint: what a rank copies for it (what it holds: it gathers nothing), and
the most bytes one rank writes in an epoch of two groups (``checkpoint.plan`` with the
shards' holders), against an even split of the whole state over the writers.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, machine

from perdure.checkpoint.plan import plan_parts
from perdure.checkpoint.tensors import flatten, meta_of
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.member.shard_group import Shards, optimizer_params
from perdure.runtime.replica.recipe import Recipe
from perdure.runtime.replica.task import build_task


def _bytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        _bytes([v for v in s.values() if isinstance(v, torch.Tensor)]) for s in opt.state.values()
    )


def written_max(state: dict, model: dict, params: list[torch.Tensor], k: int, world: int) -> float:
    """The most bytes one of ``world`` writers writes for a save of a k-sharded state,
    as a ratio of an even split (1.0: perfectly balanced)."""
    tensors, _ = flatten(model, state)
    metas = [meta_of(key, t) for key, t in tensors.items()]
    holders = {}
    if k > 1:
        shards = Shards(params, k=k, rank=0, group=None, timeout=timedelta(seconds=1))  # type: ignore[arg-type]
        holders = shards.holders(state, world)
    parts = plan_parts(metas, world, holders)
    loads = [sum(c.byte_range[1] - c.byte_range[0] for c in part) for part in parts]
    return max(loads) / (sum(loads) / world)


def one_rank(config: RunConfig, k: int, rank: int) -> dict[str, int]:
    """Parameter and optimizer-state bytes kept by ``rank`` of a group of ``k`` after one
    step (k = 1: the unsharded replica)."""
    task = build_task(config.task, config.train.seed, str(Path(__file__).resolve().parent.parent))
    recipe = Recipe(task, config.optim, config.train.steps)
    params = optimizer_params(recipe.optimizer)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    if k > 1:
        shards = Shards(params, k=k, rank=rank, group=None, timeout=timedelta(seconds=1))  # type: ignore[arg-type]
        shards.drop_foreign_grads()
    recipe.step()
    return {"params": _bytes(params), "optimizer": _state_bytes(recipe.optimizer)}


def unsharded_state(config: RunConfig) -> tuple[dict, dict, list[torch.Tensor]]:
    """(model state dict, optimizer state dict, parameters in the optimizer's order) after
    one unsharded step."""
    task = build_task(config.task, config.train.seed, str(Path(__file__).resolve().parent.parent))
    recipe = Recipe(task, config.optim, config.train.steps)
    params = optimizer_params(recipe.optimizer)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    recipe.step()
    return dict(task.model.state_dict()), recipe.state_dict(), params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, default=RESULTS / "shard.json")
    args = ap.parse_args()
    opts = {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4, "max_len": 128}
    config = with_overrides(RunConfig(), task={"options": opts})
    base = one_rank(config, 1, 0)
    whole = base["params"] + base["optimizer"]
    model, opt_state, params = unsharded_state(config)
    rows = []
    for k in args.degrees:
        ranks = [one_rank(config, k, j) for j in range(k)]
        worst = max(ranks, key=lambda r: r["optimizer"])
        row = {
            "k": k,
            "optimizer_ratio_max": round(worst["optimizer"] / base["optimizer"], 4),
            "optimizer_ratio_ideal": round(1 / k, 4),
            "params_ratio": round(worst["params"] / base["params"], 4),
            "params_plus_optimizer_ratio_max": round(
                (worst["params"] + worst["optimizer"]) / whole, 4
            ),
            "per_rank_optimizer_mb": [round(r["optimizer"] / 2**20, 2) for r in ranks],
            "save_copied_ratio_max": round((worst["params"] + worst["optimizer"]) / whole, 4),
            "save_written_balance_2_groups": round(
                written_max(opt_state, model, params, k, 2 * k), 4
            ),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "machine": machine(),
        "model": opts,
        "unsharded_mb": {"params": base["params"] / 2**20, "optimizer": base["optimizer"] / 2**20},
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
