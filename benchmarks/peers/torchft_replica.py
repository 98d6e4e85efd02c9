"""One torchft 0.2.0 replica group (one process): Manager + DDP + optimizer wrapper.

Survivors of a dead replica go on once the lighthouse drops it (heartbeat timeout); a
restarted replica heals from a live peer.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import batch, log, maybe_kill, model_and_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-log", dest="log", required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--kill-replica", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=10)
    ap.add_argument("--n-heads", type=int, default=4)
    a = ap.parse_args()
    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    model, loss_fn = model_and_loss(a.d_model, a.n_layers, a.n_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    # the replica group's store (torchrun would host it; one process per group here)
    from torch.distributed import TCPStore

    store = TCPStore(  # noqa: F841 - kept alive for the Manager
        "127.0.0.1",
        int(os.environ["MASTER_PORT"]),
        1,
        True,
        timedelta(seconds=30),
        wait_for_workers=False,
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"bench_{a.replica}",
        timeout=timedelta(seconds=10),
    )
    ddp = DistributedDataParallel(manager, model)
    optim = Optimizer(manager, opt)
    per = a.global_batch // a.replicas
    log(a.log, event="start", replica=a.replica, step=manager.current_step())
    while manager.current_step() < a.steps:
        step = manager.current_step()
        optim.zero_grad()
        loss = loss_fn(ddp, batch(step, a.replica, per)) / per
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0, foreach=False)
        ok = manager.should_commit()
        if ok:
            opt.step()
            log(
                a.log,
                event="commit",
                step=step,
                replica=a.replica,
                participants=manager.num_participants(),
            )
        else:
            log(a.log, event="abort", step=step, replica=a.replica)
        maybe_kill(a.log, a.marker, step, a.kill_at, ok and a.replica == a.kill_replica)
    log(a.log, event="done", replica=a.replica)
    os._exit(0)


if __name__ == "__main__":
    main()
