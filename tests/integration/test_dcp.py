"""Interop with PyTorch DCP: ``perdure ckpt export --format dcp`` is what an FSDP2 model and
its AdamW load with ``torch.distributed.checkpoint``, and ``perdure ckpt import`` starts a
run from a DCP checkpoint (an FSDP2 job's own included); every round trip is bit for bit,
and bad input is refused naming the key or the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from perdure.checkpoint import load_checkpoint, save_checkpoint, state_digest
from perdure.checkpoint.dcp import DcpError, write_dcp
from perdure.cli import main
from perdure.runtime.replica.dcp_import import import_dcp, whole
from perdure.runtime.replica.trainer import Trainer
from tests.dcp_support import fsdp_round_trip
from tests.runtime_support import run_to_end, sharded_config, small_config, summary

STEPS = 6


def _config(dataset: Path, **kw: Any) -> Any:
    return small_config(dataset, workers=1, slots=2, batch=4, steps=STEPS, **kw)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert _bits(a[k]) == _bits(b[k]), k


def _export(ckpt: Path, out: Path, *extra: str) -> str:
    args = ["ckpt", "export", str(ckpt), "--format", "dcp", "--out", str(out), *extra]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def _trained(config: Any, root: Path, steps: int = 2) -> Path:
    """A checkpoint after ``steps`` real steps: weights and AdamW state not the initial."""
    t = Trainer(config)
    try:
        for step in range(steps):
            bufs = [t.layout.new_buffer() for _ in range(config.train.slots)]
            assert t.compute_slots(step, range(config.train.slots), bufs)
            t.apply(step, sum(bufs[1:], bufs[0].clone()))
        return Path(save_checkpoint(root, t.checkpoint_state({})))
    finally:
        t.close()


def _by_name(ckpt: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's AdamW tensors as ``fqn/exp_avg`` -> tensor."""
    return {f"{names[i]}/{k}": v for i, s in ckpt.optimizer["state"].items() for k, v in s.items()}


@pytest.fixture(scope="module")
def trained(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained(_config(small_dataset), tmp_path_factory.mktemp("dcp-ckpt"))


def _names(config: Any) -> list[str]:
    from perdure.checkpoint.dcp import param_names

    t = Trainer(config)
    try:
        return param_names(t.module, t.recipe.optimizer)
    finally:
        t.close()


def test_an_fsdp2_model_loads_the_export_and_saves_what_import_restores_bit_for_bit(
    trained: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """perdure -> DCP -> two FSDP2 ranks (gloo, CPU): weights and AdamW state bitwise the
    checkpoint's; the FSDP2 ranks' own DCP save -> perdure import: bitwise again, the
    same state digest as the checkpoint's."""
    ckpt = load_checkpoint(trained)
    out = _export(trained, tmp_path / "dcp")
    assert "and the optimizer state" in out
    got_path = tmp_path / "fsdp.pt"
    fsdp_round_trip(2, ckpt.canonical_config, tmp_path / "dcp", tmp_path / "fsdp", got_path)
    got = torch.load(got_path, weights_only=False)
    _same(got["model"], ckpt.model)
    names = _names(_config(small_dataset))
    fsdp_state = {f"{n}/{k}": v for n, s in got["state"].items() for k, v in s.items()}
    _same(fsdp_state, _by_name(ckpt, names))
    saved_group = {k: v for k, v in ckpt.optimizer["param_groups"][0].items() if k != "params"}
    assert {k: got["param_groups"][0][k] for k in saved_group} == saved_group

    imported = import_dcp(_config(small_dataset), tmp_path / "fsdp", tmp_path / "imported")
    back = load_checkpoint(imported)
    assert back.step == 0
    _same(back.model, ckpt.model)
    _same(_by_name(back, names), _by_name(ckpt, names))
    assert state_digest(back.model, back.optimizer) == state_digest(ckpt.model, ckpt.optimizer)


@pytest.mark.parametrize("sharded", [False, True], ids=["one_worker", "k2_at_rest"])
def test_a_run_started_from_an_imported_dcp_checkpoint_is_the_run_itself_bit_for_bit(
    small_dataset: Path, tmp_path: Path, sharded: bool
) -> None:
    """A run's initial state (step 0, no AdamW state yet) exported as DCP, imported and
    resumed ends with the final hash of the run started from its seed; with two ranks
    sharded at rest too (each reads its shard of the imported checkpoint by range)."""
    cfg = _config(small_dataset)
    if sharded:
        cfg = sharded_config(small_dataset, 2, 2, steps=STEPS)
    t = Trainer(whole(cfg))
    try:
        first = Path(save_checkpoint(tmp_path / "first", t.checkpoint_state({})))
    finally:
        t.close()
    _export(first, tmp_path / "dcp")
    imported = import_dcp(cfg, tmp_path / "dcp", tmp_path / "imported")
    _same(load_checkpoint(imported).model, load_checkpoint(first).model)
    fresh = run_to_end(cfg, tmp_path / "fresh")
    resumed = run_to_end(cfg, tmp_path / "resumed", resume=str(imported))
    assert resumed["final_hash"] == fresh["final_hash"]
    assert summary(tmp_path / "resumed")["final_hash"] == fresh["final_hash"]


def test_weights_only_dcp_import_keeps_the_runs_fresh_optimizer(
    trained: Path, small_dataset: Path, tmp_path: Path
) -> None:
    _export(trained, tmp_path / "dcp", "--weights-only")
    imported = load_checkpoint(import_dcp(_config(small_dataset), tmp_path / "dcp",
                                          tmp_path / "imported"))  # fmt: skip
    _same(imported.model, load_checkpoint(trained).model)
    assert imported.optimizer["state"] == {}


def _toml(dataset: Path, path: Path, d_model: int = 32) -> Path:
    path.write_text(
        f"[task.options]\nd_model = {d_model}\nn_layers = 1\nn_heads = 2\ndropout = 0.1\n"
        f"max_len = 128\n[train]\nsteps = {STEPS}\nglobal_batch = 4\nslots = 2\n"
        f'[data]\ndataset = "{dataset}"\n[[cluster.regions]]\nname = "r0"\nworkers = 1\n'
    )
    return path


def _import(dcp_dir: Path, config: Path, out: Path) -> Any:
    args = ["ckpt", "import", str(dcp_dir), "--config", str(config), "--out", str(out)]
    return CliRunner().invoke(main, args)


def test_the_import_cli_writes_step_0_and_names_the_resume_command(
    trained: Path, small_dataset: Path, tmp_path: Path
) -> None:
    _export(trained, tmp_path / "dcp")
    config = _toml(small_dataset, tmp_path / "run.toml")
    result = _import(tmp_path / "dcp", config, tmp_path / "ckpts")
    assert result.exit_code == 0, result.output
    made = tmp_path / "ckpts" / f"step-{0:09d}"
    assert f"perdure run {config} --resume {made}" in result.output
    _same(load_checkpoint(made).model, load_checkpoint(trained).model)


def test_a_directory_that_is_not_dcp_is_refused_naming_it(
    small_dataset: Path, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    result = _import(tmp_path / "empty", _toml(small_dataset, tmp_path / "r.toml"), tmp_path / "o")
    assert result.exit_code == 2
    assert f"{tmp_path / 'empty'}: not a DCP checkpoint (no .metadata file)" in result.output
    assert not (tmp_path / "o").exists()


def test_a_dcp_checkpoint_of_another_shape_is_refused_naming_the_tensor(
    small_dataset: Path, tmp_path: Path
) -> None:
    wide = {"options": {"d_model": 64, "n_layers": 1, "n_heads": 2, "dropout": 0.1,
                        "max_len": 128}}  # fmt: skip
    other = _trained(_config(small_dataset, task=wide), tmp_path / "wide", steps=0)
    _export(other, tmp_path / "dcp")
    result = _import(tmp_path / "dcp", _toml(small_dataset, tmp_path / "r.toml"), tmp_path / "o")
    assert result.exit_code == 2
    key = next(iter(load_checkpoint(other).model))
    assert f"'{key}' is torch.float32 [" in result.output and "the model has" in result.output


def test_a_dcp_checkpoint_missing_a_model_tensor_is_refused_naming_it(
    trained: Path, small_dataset: Path, tmp_path: Path
) -> None:
    model = dict(load_checkpoint(trained).model)
    dropped = sorted(model)[-1]
    del model[dropped]
    (tmp_path / "dcp").mkdir()
    write_dcp(model, tmp_path / "dcp")
    with pytest.raises(DcpError, match=f"missing model tensor '{dropped}'"):
        import_dcp(_config(small_dataset), tmp_path / "dcp", tmp_path / "o")
