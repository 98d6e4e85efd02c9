"""The reference reader (stdlib + numpy) returns exactly what the torch loader returns."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from perdure.checkpoint import load_checkpoint, save_checkpoint
from perdure.checkpoint import reference_reader as rr
from tests.checkpoint_support import make_state, same_tree

READER = Path(rr.__file__)


def _as_numpy_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def test_reference_reader_returns_exactly_the_torch_loaders_tensors(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    loaded = load_checkpoint(path)
    reader = rr.Checkpoint(path)
    stored = {**{f"model/{k}": v for k, v in loaded.model.items()}}
    for name in reader.tensor_names():
        if name.startswith("model/"):
            t = stored[name]
            bits = reader.tensor(name, bf16="bits")
            want = _as_numpy_bits(t)
            assert bits.dtype == want.dtype and bits.shape == want.shape, name
            assert bits.tobytes() == want.tobytes(), name
    assert len(reader.tensor_names()) == len(loaded.model) + 12


def test_bf16_upcast_to_float32_is_exact(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    got = rr.Checkpoint(path).tensor("model/wbf16")
    want = load_checkpoint(path).model["wbf16"].float().numpy()
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes()


def test_reference_reader_context_equals_loaded_context(tmp_path: Path) -> None:
    state = make_state()
    path = save_checkpoint(tmp_path, state)
    ctx = rr.Checkpoint(path).context()
    loaded = load_checkpoint(path)
    for name in ("rng", "data", "canonical_config", "topology", "provenance", "decisions"):
        assert same_tree(ctx[name], getattr(loaded, name)), name
    assert ctx["config_hash"] == state.config_hash
    assert ctx["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    exp_avg = ctx["optimizer"]["state"][0]["exp_avg"]["$tensor"]
    assert rr.Checkpoint(path).tensor(exp_avg).tobytes() == (
        loaded.optimizer["state"][0]["exp_avg"].numpy().tobytes()
    )


def test_reference_reader_runs_without_torch(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, make_state())
    code = (
        "import sys, runpy; sys.modules['torch'] = None; sys.modules['safetensors'] = None; "
        f"sys.argv = ['reader', {str(path)!r}]; "
        f"runpy.run_path({str(READER)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "checksums ok" in proc.stdout
    assert "model/wbf16 BF16 [4, 3]" in proc.stdout
