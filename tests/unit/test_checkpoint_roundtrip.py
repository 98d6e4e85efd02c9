from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from perdure.checkpoint import (
    CheckpointState,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    state_digest,
)
from tests.checkpoint_support import make_state, same_bits, same_tree, trained_model_and_optimizer

FIELDS = ("step", "rng", "data", "config_hash", "canonical_config", "topology", "provenance")


def test_all_seven_fields_round_trip_bitwise(tmp_path: Path) -> None:
    state = make_state()
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    assert same_tree(state.model, loaded.model)
    assert same_tree(state.optimizer, loaded.optimizer)
    for name in FIELDS:
        assert same_tree(getattr(state, name), getattr(loaded, name)), name
    assert same_tree(state.decisions, loaded.decisions)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.randn(5).to(torch.bfloat16),
        torch.arange(6, dtype=torch.int64),
        torch.empty(0, 3),
        torch.tensor(1.5),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(2.0).to(torch.bfloat16),
    ],
    ids=["fp32", "bf16", "int64", "empty", "0d-fp32", "0d-int64", "0d-bf16"],
)
def test_each_dtype_and_shape_round_trips_alone(tmp_path: Path, tensor: torch.Tensor) -> None:
    state = make_state(extra=False)
    state.model = {"t": tensor}
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    assert same_bits(loaded.model["t"], tensor)


def test_loaded_optimizer_continues_exactly_like_the_original(tmp_path: Path) -> None:
    model, opt = trained_model_and_optimizer()
    state = make_state(extra=False)
    state.model, state.optimizer = model.state_dict(), opt.state_dict()
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    model2, opt2 = trained_model_and_optimizer(seed=99)
    model2.load_state_dict(loaded.model)
    opt2.load_state_dict(loaded.optimizer)
    x = torch.randn(5, 8)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    assert state_digest(model.state_dict(), opt.state_dict()) == state_digest(
        model2.state_dict(), opt2.state_dict()
    )


def test_restored_rng_replays_every_generator() -> None:
    rng = capture_rng(seed=5)
    first = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(10), np.random.rand(10), random.random()
    restore_rng(rng)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], again[0])
    assert np.array_equal(first[1], again[1])
    assert first[2] == again[2]


def test_digest_of_loaded_state_equals_digest_of_saved_state(tmp_path: Path) -> None:
    state = make_state()
    loaded = load_checkpoint(save_checkpoint(tmp_path, state))
    assert state_digest(state.model, state.optimizer) == state_digest(
        loaded.model, loaded.optimizer
    )


def test_digest_changes_with_one_flipped_bit_or_a_scalar() -> None:
    state = make_state()
    base = state_digest(state.model, state.optimizer)
    model = dict(state.model)
    w = model["w32"].clone()
    w.view(torch.int32)[0, 0] ^= 1
    model["w32"] = w
    assert state_digest(model, state.optimizer) != base
    opt = {**state.optimizer, "param_groups": [{**state.optimizer["param_groups"][0], "lr": 2.0}]}
    assert state_digest(state.model, opt) != base
    renamed = {("x" + k): v for k, v in state.model.items()}
    assert state_digest(renamed, state.optimizer) != base


def test_tensor_files_open_with_stock_safetensors(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    (part,) = path.glob("*.safetensors")
    with safe_open(str(part), framework="pt") as f:
        assert same_bits(f.get_tensor("model/wbf16"), state.model["wbf16"])
        assert same_bits(f.get_tensor("model/scalar"), state.model["scalar"])
        assert same_bits(f.get_tensor("model/empty"), state.model["empty"])
        assert same_bits(f.get_tensor("model/transposed"), state.model["transposed"].contiguous())
        assert len(list(f.keys())) == len(state.model) + 12  # Adam: 4 x (step, avg, sq)


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(step=5, seed=1))
    again = make_state(step=5, seed=2)
    path = save_checkpoint(tmp_path, again)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    loaded = load_checkpoint(path)
    assert same_tree(loaded.model, again.model)


def test_a_non_json_context_value_is_an_error_naming_its_path(tmp_path: Path) -> None:
    state = make_state()
    state.data = {"cursor": {"bad": object()}}
    with pytest.raises(TypeError, match="cursor/bad"):
        save_checkpoint(tmp_path, state)


def test_state_is_a_dataclass_with_the_seven_fields() -> None:
    names = set(CheckpointState.__dataclass_fields__)
    assert {"model", "optimizer", "rng", "data", "config_hash", "topology", "provenance"} <= names


def test_mapped_and_read_loads_are_bitwise_identical(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    mapped, read = load_checkpoint(path, mmap=True), load_checkpoint(path, mmap=False)
    assert same_tree(mapped.model, read.model) and same_tree(mapped.model, state.model)
    assert same_tree(mapped.optimizer, read.optimizer)
    mapped.model["w32"].add_(1)  # copy-on-write: the file is not changed
    assert same_tree(load_checkpoint(path).model, state.model)
