"""Weights out: a checkpoint's model as plain files a user loads without perdure.

The writers take a name -> tensor mapping and a directory, whatever produced the mapping
(``load_checkpoint`` today; a DCP reader can hand its tensors to the same functions), so
every export path shares one implementation of each format:

- ``safetensors``: ``model.safetensors``, for ``safetensors.torch.load_file``;
- ``torch``: ``model.pt``, a plain ``dict[str, Tensor]`` for ``torch.load(...,
  weights_only=True)``;
- ``dcp``: a PyTorch Distributed Checkpoint (``checkpoint/dcp.py``), for
  ``torch.distributed.checkpoint.load`` into a plain or FSDP2 model, with the optimizer
  state by parameter name beside the weights when given;
- ``hf``: ``save_pretrained`` of the task's own model (a ``transformers`` model), built
  from the checkpoint's config and given the checkpoint's tensors, for
  ``from_pretrained``: config.json and model.safetensors as transformers writes them
  (tied weights stored once).

Every tensor is written as saved: same dtype, same bits. Limits: only ``dcp`` carries the
optimizer state; ``hf`` needs a task whose
model has ``save_pretrained`` and the task's code importable from here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint.dcp import write_dcp
from perdure.checkpoint.tensors import plain_tensors

FORMATS = ("safetensors", "torch", "dcp", "hf")


class ExportError(ValueError):
    """The export cannot be made (an unknown format, a task without ``save_pretrained``)."""


def write_safetensors(tensors: Mapping[str, torch.Tensor], out: Path) -> list[Path]:
    from safetensors.torch import save_file

    path = out / "model.safetensors"
    save_file(plain_tensors(tensors), str(path), metadata={"format": "pt"})
    return [path]


def write_torch(tensors: Mapping[str, torch.Tensor], out: Path) -> list[Path]:
    path = out / "model.pt"
    torch.save(plain_tensors(tensors), path)
    return [path]


def write_hf(
    tensors: Mapping[str, torch.Tensor], out: Path, build_model: Callable[[], Any]
) -> list[Path]:
    model = build_model()
    if not callable(getattr(model, "save_pretrained", None)):
        raise ExportError(
            f"--format hf: the task's model ({type(model).__name__}) has no save_pretrained; "
            "use --format safetensors or torch"
        )
    model.load_state_dict(dict(tensors), strict=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return sorted(p for p in out.iterdir() if p.is_file())


def export_weights(
    tensors: Mapping[str, torch.Tensor],
    out: str | Path,
    fmt: str,
    *,
    build_model: Callable[[], Any] | None = None,
    optimizer: dict[str, Any] | None = None,
) -> list[Path]:
    """Write ``tensors`` to the directory ``out`` in ``fmt``; return the files written.
    ``optimizer``: for ``dcp`` only, the optimizer state in DCP's layout (by name).
    The directory is filled under a temporary name and renamed into place: nothing
    half-written is left behind, and an existing ``out`` is refused."""
    if fmt not in FORMATS:
        raise ExportError(f"--format: must be one of {list(FORMATS)} (got {fmt!r})")
    target = Path(out)
    if target.exists():
        raise ExportError(f"{target}: already exists; export into a new directory")
    if optimizer is not None and fmt != "dcp":
        raise ExportError(f"--format {fmt}: carries no optimizer state (only dcp does)")
    if fmt == "hf" and build_model is None:
        raise ExportError("--format hf: needs the task to build the model")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if fmt == "safetensors":
            write_safetensors(tensors, tmp)
        elif fmt == "torch":
            write_torch(tensors, tmp)
        elif fmt == "dcp":
            write_dcp(tensors, tmp, optimizer)
        else:
            assert build_model is not None
            write_hf(tensors, tmp, build_model)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; exported weights are for sharing
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p for p in target.iterdir() if p.is_file())
