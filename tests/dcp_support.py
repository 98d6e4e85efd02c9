"""An FSDP2 user's side of the DCP round trips: processes of a gloo group on the CPU that
build the task's model, shard it with ``fully_shard``, load a DCP checkpoint into it (and
into its AdamW) the way torch documents, gather what they hold, and save it back as DCP."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fsdp_round_trip(world: int, canonical: dict[str, Any], src: Path, dst: Path, got: Path) -> None:
    """``world`` processes load ``src`` into an FSDP2 model and AdamW, write the gathered
    state to ``got`` (rank 0, ``torch.save``) and save what they hold as DCP to ``dst``."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_rank, args=(world, port, canonical, src, dst, got), nprocs=world, join=True)


def _rank(rank: int, world: int, port: int, canonical: dict[str, Any], src: Path, dst: Path,
          got: Path) -> None:  # fmt: skip
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from perdure.run_config import config_from_dict
    from perdure.runtime.replica.task import build_task, plain_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_timeout())
    try:
        cfg = config_from_dict({k: v for k, v in canonical.items() if k in ("task", "run")})
        model = plain_module(build_task(cfg.task, 1234, cfg.run.base_dir).model)  # other bits
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        optim = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=False)
        msd, osd = get_state_dict(model, optim)
        state = {**msd, "optimizer": osd}
        dcp.load(state, checkpoint_id=str(src))
        osd = state.pop("optimizer")
        set_state_dict(model, optim, model_state_dict=state, optim_state_dict=osd)
        msd, osd = get_state_dict(model, optim)
        full = {k: _full(v) for k, v in msd.items()}
        per = {k: {n: _full(t) for n, t in s.items()} for k, s in osd["state"].items()}
        if rank == 0:
            torch.save({"model": full, "state": per, "param_groups": osd["param_groups"]}, got)
        dcp.save({**msd, "optimizer": osd}, checkpoint_id=str(dst))
        dist.barrier()  # no rank tears its group down while the other is still in a call
    finally:
        dist.destroy_process_group()


def _full(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _timeout() -> Any:
    import datetime

    return datetime.timedelta(seconds=120)
