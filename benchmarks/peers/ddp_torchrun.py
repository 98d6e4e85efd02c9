"""Plain DDP (gloo) with a periodic torch.save checkpoint, started by torchrun --max-restarts.

A restart resumes from the newest checkpoint: the steps since it are recomputed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import batch, log, maybe_kill, model_and_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-log", dest="log", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=10)
    ap.add_argument("--n-heads", type=int, default=4)
    a = ap.parse_args()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, loss_fn = model_and_loss(a.d_model, a.n_layers, a.n_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ckpt = Path(a.ckpt_dir) / "latest.pt"
    start = 0
    if ckpt.exists():
        sd = torch.load(ckpt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        start = int(sd["step"])
    ddp = DDP(model)
    if rank == 0:
        log(
            a.log,
            event="start",
            step=start,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        )
    per = a.global_batch // world
    # several kills (goodput runs): BENCH_KILL_STEPS=50,100,...; each fires once
    env_kills = os.environ.get("BENCH_KILL_STEPS", "")
    kills = [int(x) for x in env_kills.split(",") if x] or ([a.kill_at] if a.kill_at >= 0 else [])
    for step in range(start, a.steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, batch(step, rank, per)) / per
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, foreach=False)
        opt.step()
        if rank == 0:
            log(a.log, event="commit", step=step)
        if (step + 1) % a.ckpt_every == 0:
            if rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                with open(tmp, "wb") as f:
                    torch.save(
                        {"model": model.state_dict(), "optim": opt.state_dict(), "step": step + 1},
                        f,
                    )
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, ckpt)
            dist.barrier()
        for k in kills:
            maybe_kill(a.log, str(Path(a.ckpt_dir) / f"killed-{k}"), step, k, rank == a.kill_rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
