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
import threading
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


def make(args: argparse.Namespace) -> dict[str, Any]:
    """The state after one AdamW step, saved by perdure at W = 2, k = 2, and exported
    as DCP (one process) for the FSDP2 ranks to start from."""
    import torch

    from perdure.checkpoint import CheckpointState, save_checkpoint
    from perdure.checkpoint.dcp import optimizer_by_name, param_names, write_dcp
    from perdure.runtime.shard_plan import owners

    torch.manual_seed(0)
    model = _model(args)
    optim = _optimizer(model.parameters())
    tokens = torch.randint(0, 256, (2, 64))
    model(tokens).float().pow(2).mean().backward()
    optim.step()
    osd = optim.state_dict()
    params = list(model.parameters())
    owner = owners([p.numel() for p in params], 2)
    names = param_names(model, optim)
    holders: dict[str, tuple[int, ...]] = {}
    for i, name in enumerate(names):
        ranks = (owner[i],)  # W = 2, k = 2: one group, shard j on rank j
        holders[f"model/{name}"] = ranks
        for key in osd["state"][i]:
            holders[f"optimizer/state/{i}/{key}"] = ranks
    state = CheckpointState(step=1, model=model.state_dict(), optimizer=osd, rng={}, data={},
                            config_hash="bench", canonical_config={}, topology={},
                            provenance={})  # fmt: skip
    root = Path(args.dir) / "perdure"
    rounds: dict[str, dict[int, Any]] = {}
    cond = threading.Condition()

    def exchange(payload: dict[str, Any]) -> list[dict[str, Any]]:
        with cond:
            got = rounds.setdefault(payload["round"], {})
            got[payload["rank"]] = payload
            cond.notify_all()
            cond.wait_for(lambda: len(got) == 2, timeout=300)
            return [got[0], got[1]]

    paths: list[Any] = [None, None]

    def write(rank: int) -> None:
        paths[rank] = save_checkpoint(root, state, rank=rank, world=2, exchange=exchange,
                                      holders=holders)  # fmt: skip

    t0 = time.perf_counter()
    threads = [threading.Thread(target=write, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    save_s = time.perf_counter() - t0
    (Path(args.dir) / "dcp1").mkdir()
    write_dcp(model.state_dict(), Path(args.dir) / "dcp1", optimizer_by_name(osd, names))
    nparams = sum(p.numel() for p in params)
    ckpt = Path(paths[0])
    nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
    return {"params": nparams, "ckpt": str(ckpt), "perdure_save_s_threads": save_s,
            "ckpt_bytes": nbytes}  # fmt: skip


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
            t0 = time.perf_counter()
            dcp.save({**msd, "optimizer": osd}, checkpoint_id=args.save)
            dist.barrier()
            out["save_seconds"] = time.perf_counter() - t0
        return out
    finally:
        dist.destroy_process_group()


ROLES = {"perdure": perdure_rank, "whole": whole_rank, "fsdp": fsdp_rank, "make": make}


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
        dcp_dir = str(Path(tmp) / "dcp")
        saved = _spawn(args, "fsdp", 2, src=str(Path(tmp) / "dcp1"), save=dcp_dir)
        dcp_bytes = sum(f.stat().st_size for f in Path(dcp_dir).iterdir())
        result = {
            "machine": machine(),
            "model": {
                "d_model": args.d_model,
                "layers": args.layers,
                "params": made["params"],
                "optimizer": "AdamW",
            },
            "written": {"perdure": "W=2, k=2 (threads)", "dcp": "FSDP2, 2 ranks"},
            "files": {
                "perdure_bytes": made["ckpt_bytes"],
                "dcp_bytes": dcp_bytes,
                "dcp_save_s": max(r["save_seconds"] for r in saved),
                "perdure_save_s": made["perdure_save_s_threads"],
            },
            "load_ranks": args.ranks,
            "perdure": _summary(_spawn(args, "perdure", args.ranks, ckpt=made["ckpt"])),
            "dcp": _summary(_spawn(args, "fsdp", args.ranks, src=dcp_dir)),
            "perdure_whole": _summary(_spawn(args, "whole", 1, ckpt=made["ckpt"])),
        }
    for name in ("perdure", "dcp", "perdure_whole"):
        r = result[name]
        print(f"{name:14s} peak extra {r['max_peak_extra_mb']:8.1f} MB  over shard "
              f"{r['max_over_shard_mb']:7.1f} MB  {r['max_seconds']:.3f} s")  # fmt: skip
    print(f"saved in {write_result('reshard_load', result, args.out)}")


if __name__ == "__main__":
    main()
