"""Deferred initialisation (``runtime/replica/deferred.py``): a model built with its
parameters on ``meta``, then each module initialised from a seed of its own, so any
subset of modules on any rank gets the same bits as the whole model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from perdure.runtime.replica.deferred import build_deferred, materialize, module_seed


class _Tiny(nn.Module):
    """An embedding tied to the head, a custom init in ``__init__``, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(3)
        )
        self.head = nn.Linear(16, 50)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)  # a no-op on meta: the task's init decides
        self.register_buffer("pos", torch.arange(8.0))


def _init(name: str, module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        return True
    return False


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if resident(p)}


def resident(p: torch.Tensor) -> bool:
    return p.untyped_storage().nbytes() > 0


def test_building_allocates_no_parameter_bytes_and_keeps_buffers_and_ties() -> None:
    model = build_deferred(_Tiny)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert torch.equal(model.pos, torch.arange(8.0))  # buffers are built for real
    assert model.head.weight is model.tok.weight
    ours = nn.Linear(2, 2)  # the hook is gone once the factory returns
    assert ours.weight.device.type == "cpu"


def test_every_subset_of_modules_gets_the_whole_models_bits_in_any_order() -> None:
    whole = build_deferred(_Tiny)
    done = materialize(whole, seed=7, init=_init)
    blocks = [f"blocks.{b}.{i}" for b in range(3) for i in range(2)]
    assert done == ["tok", *blocks, "head"]
    want = _state(whole)
    assert whole.tok.weight.std() < 0.05  # the task's init took the embedding
    assert whole.head.weight is whole.tok.weight  # still tied, now real
    for kept in ({"blocks.1.1", "head"}, {"tok", "blocks.0.0"}, {"blocks.2.1"}):
        part = build_deferred(_Tiny)
        materialize(part, seed=7, init=_init, keep=lambda n, _m, kept=kept: n in kept)
        got = _state(part)
        for name, t in got.items():
            assert torch.equal(t, want[name]), name
        holder = {n: n.rsplit(".", 1)[0] for n, _ in part.named_parameters()}  # first holder
        assert set(got) == {n for n, m in holder.items() if m in kept}  # the rest at rest
        assert all(p.device.type == "cpu" for p in part.parameters())
    other = build_deferred(_Tiny)
    materialize(other, seed=8, init=_init)
    assert not torch.equal(_state(other)["blocks.0.1.weight"], want["blocks.0.1.weight"])


def test_a_tied_parameter_is_its_first_holders_whichever_modules_a_rank_keeps() -> None:
    """The head's ``reset_parameters`` runs with a stand-in for the tied weight: the
    embedding's init (std 0.02) stands, kept or not beside the head."""
    both = build_deferred(_Tiny)
    materialize(both, seed=3, init=_init)
    head_only = build_deferred(_Tiny)
    materialize(head_only, seed=3, init=_init, keep=lambda n, _m: n == "head")
    assert torch.equal(head_only.head.bias, both.head.bias)
    assert not resident(head_only.tok.weight)  # the tie followed its first holder: at rest
    assert both.tok.weight.std() < 0.05


def test_a_module_with_no_way_to_initialise_its_parameters_is_named() -> None:
    class Raw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Raw()

    model = build_deferred(Outer)
    with pytest.raises(ValueError, match=r"module 'inner' \(Raw\) has parameters of its own"):
        materialize(model, seed=1)
    took = build_deferred(Outer)
    materialize(
        took, seed=1, init=lambda n, m: n == "inner" and bool(m.scale.data.fill_(2.0).all())
    )
    assert torch.equal(took.inner.scale, torch.full((4,), 2.0))


def test_module_seeds_are_a_pure_function_of_the_run_seed_and_the_name() -> None:
    assert module_seed(1, "a") == module_seed(1, "a")
    assert len({module_seed(1, "a"), module_seed(1, "b"), module_seed(2, "a")}) == 3
    state = torch.default_generator.get_state()
    materialize(build_deferred(_Tiny), seed=5, init=_init)
    assert torch.equal(torch.default_generator.get_state(), state)  # the run's stream untouched
