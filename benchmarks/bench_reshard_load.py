"""Loading a checkpoint at another layout, per rank: perdure's read by shard against DCP's
load into FSDP2, peak RSS and time, for the same model and AdamW state.

    flock /tmp/perdure-bench.lock .venv/bin/python benchmarks/bench_reshard_load.py
    ... --d-model 256 --layers 4                          # small, seconds

The state: a TinyLM (``examples/tiny_lm``; d_model 512, 8 layers: about 25M parameters)
after one AdamW step, so every optimizer tensor is real. It is written twice:

- perdure: ``save_checkpoint`` by W = 2 writers as a k = 2 group writes it (each
  parameter and its AdamW state by its owner's ranks, ``shard_plan.owners``);
- DCP: by two FSDP2 ranks (``fully_shard``, gloo on the CPU), ``dcp.save`` of the model
  and ``get_state_dict``'s optimizer state (timed: DCP's save; perdure's save is timed
  too, its two writers threads of one process, with fsync).

Then each is loaded at k' = ``--ranks`` (3) ranks, one fresh process per rank:

- ``perdure``: what ``Trainer.load`` with ``train.shard_params`` does: ``open_lazy``
  (manifest, headers, context; no tensor), then the rank's own parameters
  (``owners(numels, k')``) and their AdamW state read by byte range into fresh tensors;
- ``dcp``: an FSDP2 model built on ``meta``, ``fully_shard`` over k' ranks,
  ``to_empty``, ``get_state_dict`` (the template; it initialises the AdamW state),
  ``dcp.load``, ``set_state_dict``: the documented FSDP2 recipe (``dcp_load_seconds``:
  the ``dcp.load`` call alone);
- ``perdure_whole``: ``load_checkpoint`` (every byte mapped and checked), for contrast.

Peak RSS is the kernel's high-water mark (``VmHWM``), reset (``/proc/self/clear_refs``)
after the imports and the model's skeleton, so it counts what the load adds, the rank's
own shard included; ``over`` is that minus the shard's bytes (parameters + AdamW state).
Both read from the page cache (the files were just written). Results:
``benchmarks/results/reshard_load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import free_port, machine, write_result

MB = 1 << 20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS; return that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _model(args: argparse.Namespace, device: str = "cpu") -> Any:
    import torch

    from examples.tiny_lm.task import TinyLM

    with torch.device(device):
        return TinyLM(vocab=256, d_model=args.d_model, n_layers=args.layers,
                      n_heads=8, max_len=512, dropout=0.0)  # fmt: skip


def _optimizer(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


# -- making the state -------------------------------------------------------------------


def _state(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, tuple[int, ...]]]:
    """(model, optimizer, perdure state, holders): the state after one AdamW step (the
    same bits in every process), each parameter and its moments held by its owner's rank
    of a W = 2, k = 2 group (``shard_plan.owners``)."""
    import torch

    from perdure.checkpoint import CheckpointState
    from perdure.checkpoint.dcp import param_names
    from perdure.runtime.shard_plan import owners

    torch.manual_seed(0)
    model = _model(args)
    optim = _optimizer(model.parameters())
    tokens = torch.randint(0, 256, (2, 64))
    model(tokens).float().pow(2).mean().backward()
    optim.step()
    model.zero_grad(set_to_none=True)
    osd = optim.state_dict()
    owner = owners([p.numel() for p in model.parameters()], 2)
    holders: dict[str, tuple[int, ...]] = {}
    for i, name in enumerate(param_names(model, optim)):
        holders[f"model/{name}"] = (owner[i],)  # W = 2, k = 2: shard j on rank j
        for key in osd["state"][i]:
            holders[f"optimizer/state/{i}/{key}"] = (owner[i],)
    state = CheckpointState(step=1, model=model.state_dict(), optimizer=osd, rng={}, data={},
                            config_hash="bench", canonical_config={}, topology={},
                            provenance={})  # fmt: skip
    return model, optim, state, holders


def make(args: argparse.Namespace) -> dict[str, Any]:
    """The state exported as DCP by one process, for the FSDP2 ranks to start from."""
    from perdure.checkpoint.dcp import optimizer_by_name, param_names, write_dcp

    model, optim, state, _ = _state(args)
    (Path(args.dir) / "dcp1").mkdir()
    names = param_names(model, optim)
    write_dcp(state.model, Path(args.dir) / "dcp1", optimizer_by_name(state.optimizer, names))
    return {"params": sum(p.numel() for p in model.parameters())}


def perdure_save_rank(args: argparse.Namespace) -> dict[str, Any]:
    """Rank ``--rank`` of a W = 2, k = 2 group sharded at rest saves: it holds its shard
    only (the rest ``meta``, as ``Trainer.checkpoint_state`` gives it), and the writers
    agree over a TCP store (``StoreExchange``, as a run's ranks do)."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    from perdure.checkpoint import save_checkpoint
    from perdure.checkpoint.tensors import flatten
    from perdure.runtime.comm.exchange import StoreExchange

    model, optim, state, holders = _state(args)
    del model, optim
    tensors, _ = flatten(state.model, state.optimizer)
    meta = {id(t) for k, t in tensors.items() if args.rank not in holders.get(k, (args.rank,))}

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and id(v) in meta:
            return torch.empty(v.shape, dtype=v.dtype, device="meta")
        if isinstance(v, dict):
            return {k: cut(x) for k, x in v.items()}
        return v

    state.model, state.optimizer = cut(state.model), cut(state.optimizer)
    del tensors
    gc.collect()
    held = flatten(state.model, state.optimizer)[0].values()
    shard = sum(t.nbytes for t in held if t.device.type != "meta")
    wait = datetime.timedelta(seconds=300)
    server = dist.TCPStore("127.0.0.1", args.port, 2, args.rank == 0, wait,
                           wait_for_workers=False)  # fmt: skip

    def connect(timeout_s: float) -> Any:
        seconds = datetime.timedelta(seconds=timeout_s)
        return dist.TCPStore("127.0.0.1", args.port, 2, False, seconds)

    ex = StoreExchange(connect, "bench/", args.rank, 2, lambda: False)
    root = Path(args.dir) / "perdure"
    base = _reset_peak()
    t0 = time.perf_counter()
    path = save_checkpoint(root, state, rank=args.rank, world=2, exchange=ex, holders=holders)
    secs = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    server.set(f"done/{args.rank}", "1")
    server.wait([f"done/{r}" for r in range(2)])
    files = [f for f in Path(path).iterdir()]
    return {"rank": args.rank, "seconds": secs, "peak_extra": peak, "shard_bytes": shard,
            "ckpt": str(path), "bytes": sum(f.stat().st_size for f in files),
            "files": len(files)}  # fmt: skip


# -- loading, one rank per process ------------------------------------------------------


def perdure_rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from perdure.checkpoint.ranges import open_lazy
    from perdure.runtime.shard_plan import owners

    skeleton = _model(args, "meta")  # what the rank knows before it loads: shapes
    numels = [p.numel() for p in skeleton.parameters()]
    owner = owners(numels, args.k)
    base = _reset_peak()
    t0 = time.perf_counter()
    lazy = open_lazy(args.ckpt)
    names = [n for n, _ in skeleton.named_parameters()]
    mine = [i for i, o in enumerate(owner) if o == args.rank]
    params = {}
    for i in mine:
        meta = lazy.loaded.model[names[i]]
        params[names[i]] = torch.empty(meta.shape, dtype=meta.dtype)
    lazy.reader.fill([(f"model/{n}", t) for n, t in params.items()])
    state = lazy.loaded.optimizer["state"]
    own = lazy.resolve({i: state[i] for i in mine})
    secs = time.perf_counter() - t0
    shard = sum(t.nbytes for t in params.values())
    shard += sum(v.nbytes for s in own.values() for v in s.values())
    return {"rank": args.rank, "seconds": secs, "peak_extra": _status("VmHWM") - base,
            "shard_bytes": shard, "read_bytes": lazy.reader.bytes_read}  # fmt: skip


def whole_rank(args: argparse.Namespace) -> dict[str, Any]:
    from perdure.checkpoint import load_checkpoint

    base = _reset_peak()
    t0 = time.perf_counter()
    loaded = load_checkpoint(args.ckpt)
    secs = time.perf_counter() - t0
    from perdure.checkpoint.tensors import flatten

    held = sum(t.nbytes for t in flatten(loaded.model, loaded.optimizer)[0].values())
    return {"rank": 0, "seconds": secs, "peak_extra": _status("VmHWM") - base,
            "shard_bytes": held}  # fmt: skip


def fsdp_rank(args: argparse.Namespace) -> dict[str, Any]:
    """One FSDP2 rank: load ``--src`` (DCP) and, with ``--save``, save to it (timed)."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.k,
                            timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        model = _model(args, "meta")
        mesh = init_device_mesh("cpu", (args.k,))
        for block in model.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        base = _reset_peak()
        t0 = time.perf_counter()
        model.to_empty(device="cpu")
        optim = _optimizer(model.parameters())
        msd, osd = get_state_dict(model, optim)
        state = {**msd, "optimizer": osd}
        t1 = time.perf_counter()
        dcp.load(state, checkpoint_id=args.src)
        load_only = time.perf_counter() - t1
        osd = state.pop("optimizer")
        set_state_dict(model, optim, model_state_dict=state, optim_state_dict=osd)
        secs = time.perf_counter() - t0
        peak = _status("VmHWM") - base
        shard = sum(p.to_local().nbytes for p in model.parameters())
        shard += sum(
            (v.to_local() if hasattr(v, "to_local") else v).nbytes
            for s in optim.state.values() for v in s.values()
        )  # fmt: skip
        out = {"rank": args.rank, "seconds": secs, "peak_extra": peak, "shard_bytes": shard,
               "dcp_load_seconds": load_only}  # fmt: skip
        if args.save:
            msd, osd = get_state_dict(model, optim)
            dist.barrier()
            base = _reset_peak()
            t0 = time.perf_counter()
            dcp.save({**msd, "optimizer": osd}, checkpoint_id=args.save)
            out["save"] = {"rank": args.rank, "seconds": time.perf_counter() - t0,
                           "peak_extra": _status("VmHWM") - base, "shard_bytes": shard}  # fmt: skip
            dist.barrier()
        dist.barrier()  # no rank tears its group down while another is still in a call
        return out
    finally:
        dist.destroy_process_group()


ROLES = {"perdure": perdure_rank, "whole": whole_rank, "fsdp": fsdp_rank, "make": make,
         "psave": perdure_save_rank}  # fmt: skip


def _spawn(args: argparse.Namespace, role: str, ranks: int, **extra: Any) -> list[dict[str, Any]]:
    """``ranks`` processes of ``role`` at once; their JSON results."""
    port = free_port()
    procs = []
    for r in range(ranks):
        cmd = [sys.executable, __file__, "--role", role, "--rank", str(r), "--k", str(ranks),
               "--port", str(port), "--dir", args.dir, "--d-model", str(args.d_model),
               "--layers", str(args.layers)]  # fmt: skip
        for k, v in extra.items():
            cmd += [f"--{k}", str(v)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"{role} rank failed with {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    over = [r["peak_extra"] - r["shard_bytes"] for r in rows]
    return {
        "ranks": rows,
        "max_peak_extra_mb": round(max(r["peak_extra"] for r in rows) / MB, 1),
        "max_over_shard_mb": round(max(over) / MB, 1),
        "max_seconds": round(max(r["seconds"] for r in rows), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=3, help="k': the ranks that load")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role is not None:
        print(json.dumps(ROLES[args.role](args)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="reshard-") as tmp:
        args.dir = tmp
        made = _spawn(args, "make", 1)[0]
        psaved = _spawn(args, "psave", 2)
        ckpt = psaved[0]["ckpt"]
        dcp_dir = Path(tmp) / "dcp"
        saved = _spawn(args, "fsdp", 2, src=str(Path(tmp) / "dcp1"), save=str(dcp_dir))
        dcp_files = list(dcp_dir.iterdir())
        result = {
            "machine": machine(),
            "model": {
                "d_model": args.d_model,
                "layers": args.layers,
                "params": made["params"],
                "optimizer": "AdamW",
            },
            "files": {
                "perdure_bytes": psaved[0]["bytes"],
                "perdure_files": psaved[0]["files"],
                "dcp_bytes": sum(f.stat().st_size for f in dcp_files),
                "dcp_files": len(dcp_files),
            },
            "save_perdure": _summary(psaved),
            "save_dcp": _summary([r["save"] for r in saved]),
            "load_ranks": args.ranks,
            "perdure": _summary(_spawn(args, "perdure", args.ranks, ckpt=ckpt)),
            "dcp": _summary(_spawn(args, "fsdp", args.ranks, src=str(dcp_dir))),
            "perdure_whole": _summary(_spawn(args, "whole", 1, ckpt=ckpt)),
        }
    for name in ("save_perdure", "save_dcp", "perdure", "dcp", "perdure_whole"):
        r = result[name]
        over = "" if name.startswith("save") else f"  over shard {r['max_over_shard_mb']:7.1f} MB"
        print(
            f"{name:14s} peak RSS added {r['max_peak_extra_mb']:8.1f} MB{over}  "
            f"{r['max_seconds']:.3f} s"
        )
    print(f"saved in {write_result('reshard_load', result, args.out)}")


if __name__ == "__main__":
    main()
