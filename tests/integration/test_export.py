"""`perdure ckpt export`: a checkpoint's weights as plain files that safetensors, torch and
transformers load without perdure, equal to the checkpoint's tensors bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from perdure.checkpoint import load_checkpoint, save_checkpoint
from perdure.cli import main
from perdure.runtime.replica.trainer import Trainer
from tests.runtime_support import run_to_end, sharded_config, small_config


def _export(ckpt: Path, fmt: str, out: Path) -> str:
    result = CliRunner().invoke(main, ["ckpt", "export", str(ckpt), "--format", fmt,
                                       "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result.output


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def _trained_checkpoint(config: Any, root: Path) -> Path:
    """A checkpoint after two real steps (the weights are not the initial ones)."""
    t = Trainer(config)
    try:
        for step in range(2):
            bufs = [t.layout.new_buffer() for _ in range(config.train.slots)]
            assert t.compute_slots(step, range(config.train.slots), bufs)
            t.apply(step, sum(bufs[1:], bufs[0].clone()))
        return Path(save_checkpoint(root, t.checkpoint_state({})))
    finally:
        t.close()


@pytest.fixture(scope="module")
def checkpoint(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export-ckpt")
    return _trained_checkpoint(small_config(small_dataset, workers=1, slots=2, batch=4), root)


def test_safetensors_and_torch_exports_load_bitwise_equal_to_the_checkpoint(
    checkpoint: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    saved = load_checkpoint(checkpoint).model
    _export(checkpoint, "safetensors", tmp_path / "st")
    _bitwise(load_file(str(tmp_path / "st" / "model.safetensors")), saved)
    _export(checkpoint, "torch", tmp_path / "pt")
    _bitwise(torch.load(tmp_path / "pt" / "model.pt", weights_only=True), saved)


def test_an_export_into_an_existing_directory_is_refused_and_leaves_nothing(
    checkpoint: Path, tmp_path: Path
) -> None:
    (tmp_path / "taken").mkdir()
    result = CliRunner().invoke(main, ["ckpt", "export", str(checkpoint), "--out",
                                       str(tmp_path / "taken")])  # fmt: skip
    assert result.exit_code == 2 and "already exists" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_a_sharded_checkpoint_exports_whole_bitwise(small_dataset: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = sharded_config(small_dataset, 2, 2, steps=4)
    run_to_end(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{4:09d}"
    _export(tmp_path / "run", "safetensors", tmp_path / "st")  # a run dir: its newest
    _bitwise(load_file(str(tmp_path / "st" / "model.safetensors")), load_checkpoint(ckpt).model)


def test_the_hf_example_exports_for_from_pretrained_bitwise(
    small_dataset: Path, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    hf = {"entry": "examples.hf_lm.task:make_task",
          "options": {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1,
                      "max_len": 128}}  # fmt: skip
    cfg = small_config(small_dataset, workers=1, slots=2, batch=4, task=hf)
    ckpt = _trained_checkpoint(cfg, tmp_path / "ckpts")
    _export(ckpt, "hf", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    _bitwise(model.state_dict(), load_checkpoint(ckpt).model)
