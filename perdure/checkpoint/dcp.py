"""PyTorch Distributed Checkpoint (DCP) out and in: what an FSDP user loads, and what a
perdure run can start from.

The layout written is the one ``torch.distributed.checkpoint.state_dict`` speaks (and
torchtitan writes):

- every model tensor at the top level under its ``state_dict()`` name, so
  ``dcp.load(model.state_dict(), checkpoint_id=DIR)`` fills a plain or an FSDP2 model
  (DCP reshards on read);
- under ``"optimizer"``, the optimizer state keyed by parameter name (FQN), the layout of
  ``get_optimizer_state_dict``: ``{"state": {fqn: {"step", "exp_avg", ...}},
  "param_groups": [{hyperparameters..., "params": [fqn, ...]}]}``. A user loads it with
  ``get_state_dict(model, optim)`` for a template, ``dcp.load``, then ``set_state_dict``.

It is written by this one process (``no_dist=True``: no process group): ``.metadata`` and
one ``.distcp`` file. Every tensor keeps its dtype and its bits.

Reading checks the checkpoint against the model first (every model key present, as a
tensor of the model's shape and dtype) and names the first key that fails, before any
tensor data is read.

Limits: the task's own scheduler state, the exact reduction's carried exponents and the
fp16 loss scale are not the optimizer's, so they are not exported (an imported run starts
them fresh); the whole state passes through this process's memory (a conversion tool, not
a run's load path); the optimizer part is read with torch's private ``_EmptyStateDictLoadPlanner``
(as torch's own ``dcp_to_torch_save`` does), which the pinned torch version keeps.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint.tensors import plain_tensors

OPTIMIZER_KEY = "optimizer"
"""The top-level key of the optimizer state (torchtitan's)."""
METADATA = ".metadata"


class DcpError(ValueError):
    """A DCP checkpoint that cannot be written or read as asked, naming the key or file."""


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that no process group exists even with ``no_dist=True``; that is the
    intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# -- optimizer state: by parameter index (torch) <-> by parameter name (DCP) --------------


def param_names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name (FQN) of each of ``optimizer``'s parameters in its state-dict index order
    (groups in order, parameters in group order); a tied parameter has its first name."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    out = []
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise DcpError(f"optimizer param group {i}: holds a tensor that is not a "
                               "parameter of the model")  # fmt: skip
            out.append(names[id(p)])
    return out


def optimizer_by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A torch optimizer ``state_dict()`` (parameters by index) in DCP's layout (by name).
    Only ``state`` and ``param_groups`` are kept: other keys are not the optimizer's."""
    try:
        by_name = {names[i]: dict(s) for i, s in state["state"].items()}
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    except (IndexError, KeyError, TypeError) as e:
        raise DcpError(f"optimizer state: not a torch optimizer state dict ({e!r})") from None
    return {"state": by_name, "param_groups": groups}


def optimizer_by_index(
    state: Mapping[str, Any], names: Sequence[str], where: str
) -> dict[str, Any]:
    """DCP's optimizer layout (by name) as the torch state dict of the optimizer whose
    parameters are ``names`` (index order): each group's hyperparameters from ``state``,
    its parameters in the optimizer's own order. A group whose parameters are not the
    optimizer's group's, or state for a parameter the model lacks, is refused by name."""
    index = {n: i for i, n in enumerate(names)}
    groups_in = state.get("param_groups")
    per_state = state.get("state", {})
    if not isinstance(groups_in, list) or not isinstance(per_state, dict):
        raise DcpError(f"{where}: {OPTIMIZER_KEY} must hold 'state' (a dict) and "
                       "'param_groups' (a list)")  # fmt: skip
    for fqn in per_state:
        if fqn not in index:
            raise DcpError(f"{where}: {OPTIMIZER_KEY}.state.{fqn}: no such parameter in the "
                           "model")  # fmt: skip
    groups, used = [], 0
    for i, g in enumerate(groups_in):
        params = list(g.get("params", []))
        unknown = [p for p in params if p not in index]
        if unknown:
            raise DcpError(f"{where}: {OPTIMIZER_KEY}.param_groups[{i}] names {unknown[0]!r}, "
                           "no parameter of the model")  # fmt: skip
        idx = sorted(index[p] for p in params)
        if idx != list(range(used, used + len(idx))):
            raise DcpError(
                f"{where}: {OPTIMIZER_KEY}.param_groups[{i}] holds {len(params)} parameters "
                f"that are not the run optimizer's group {i} (starting at {names[used]!r})"
            )
        groups.append({**g, "params": idx})
        used += len(idx)
    if used != len(names):
        raise DcpError(f"{where}: {OPTIMIZER_KEY}.param_groups cover {used} parameters, the "
                       f"run's optimizer has {len(names)}")  # fmt: skip
    return {"state": {index[n]: dict(s) for n, s in per_state.items()}, "param_groups": groups}


# -- writing --------------------------------------------------------------------------------


def write_dcp(
    tensors: Mapping[str, torch.Tensor], out: Path, optimizer: dict[str, Any] | None = None
) -> list[Path]:
    """``tensors`` (a model's state dict) at the top level and ``optimizer`` (DCP's
    layout, see :func:`optimizer_by_name`) under ``"optimizer"``, as a DCP checkpoint in
    the existing, empty directory ``out``."""
    import torch.distributed.checkpoint as dcp

    if OPTIMIZER_KEY in tensors:
        raise DcpError(f"model/{OPTIMIZER_KEY}: a model tensor has the name DCP's layout "
                       "keeps for the optimizer state")  # fmt: skip
    state: dict[str, Any] = plain_tensors(tensors)
    if optimizer is not None:
        state[OPTIMIZER_KEY] = optimizer
    with _single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return sorted(p for p in out.iterdir() if p.is_file())


# -- reading --------------------------------------------------------------------------------


def read_metadata(path: str | Path) -> Any:
    """The checkpoint's DCP metadata; a directory that is not a DCP checkpoint is an error
    naming it."""
    from torch.distributed.checkpoint import FileSystemReader

    p = Path(path)
    if not p.is_dir():
        raise DcpError(f"{p}: not a DCP checkpoint (not a directory)")
    if not (p / METADATA).is_file():
        raise DcpError(f"{p}: not a DCP checkpoint (no {METADATA} file)")
    try:
        return FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # a torn or foreign .metadata: a pickle error of any type
        raise DcpError(f"{p / METADATA}: unreadable DCP metadata ({e!r:.200})") from None


def check_model(meta: Any, model: Mapping[str, torch.Tensor], where: str) -> None:
    """Every model tensor is in the checkpoint, a tensor of the same shape and dtype."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = meta.state_dict_metadata
    for name, t in model.items():
        m = saved.get(name)
        if m is None:
            raise DcpError(f"{where}: missing model tensor {name!r} (the model has "
                           f"{t.dtype} {list(t.shape)})")  # fmt: skip
        if not isinstance(m, TensorStorageMetadata):
            raise DcpError(f"{where}: {name!r} is not a tensor in the checkpoint")
        if tuple(m.size) != tuple(t.shape) or m.properties.dtype != t.dtype:
            raise DcpError(f"{where}: {name!r} is {m.properties.dtype} {list(m.size)}, the "
                           f"model has {t.dtype} {list(t.shape)}")  # fmt: skip


def has_optimizer(meta: Any) -> bool:
    data = meta.planner_data or {}
    return any(next(iter(data.get(k, (k,)))) == OPTIMIZER_KEY for k in meta.state_dict_metadata)


def read_dcp(
    path: str | Path, model: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``(model tensors, optimizer state in DCP's layout or None)`` from the DCP checkpoint
    at ``path``; ``model`` (a state dict, values unused) says which tensors to read and
    what each must be. Keys that are neither the model's nor the optimizer's (a data
    loader's, a scheduler's) are left unread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    where = str(path)
    meta = read_metadata(path)
    check_model(meta, model, where)
    out = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in model.items()}
    reader = dcp.FileSystemReader(where)
    with _single_process():
        dcp.load(out, storage_reader=reader, no_dist=True)
        if not has_optimizer(meta):
            return out, None
        optim: dict[str, Any] = {}
        _load_state_dict(
            optim,
            storage_reader=dcp.FileSystemReader(where),
            planner=_EmptyStateDictLoadPlanner(keys={OPTIMIZER_KEY}),
            no_dist=True,
        )
    return out, optim.get(OPTIMIZER_KEY)
