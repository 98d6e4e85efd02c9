"""Generator states as JSON: the run seed, torch CPU (and CUDA), numpy's global, python's,
and how each slot seeds them (``slots``).

Byte states (torch) are base64; numpy's MT19937 key is a list of ints; python's
``random.getstate()`` is a tuple of ints (tagged JSON keeps it a tuple). No pickle.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

SLOT_SEEDING = {
    "derivation": "blake2b-64('{seed}:{step}:{slot}') >> 1",
    "seeded": ["torch_cpu", "torch_cuda", "numpy_global", "python_random", "slot_generator"],
}
"""How every slot seeds the user's generators (``runtime.replica.user_rng``): from the
slot's seed alone, restored after the slot, so the states saved beside it are the ones
outside slots (a function of the run seed), whoever computed which slot."""


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng(seed: int) -> dict[str, Any]:
    """Every generator state that matters, plus the run seed."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    out: dict[str, Any] = {
        "seed": int(seed),
        "torch_cpu": _b64(torch.get_rng_state()),
        "numpy": {
            "bit_generator": str(name),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "python": random.getstate(),
        "slots": SLOT_SEEDING,
    }
    if torch.cuda.is_available():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(rng: dict[str, Any]) -> None:
    """Set every generator captured by :func:`capture_rng`. CUDA states are restored only
    when CUDA is available (a CPU resume of a GPU run keeps going, with CPU generators)."""
    torch.set_rng_state(_unb64(rng["torch_cpu"]))
    n = rng["numpy"]
    keys = np.array(n["keys"], dtype=np.uint32)
    np.random.set_state((n["bit_generator"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    py = rng["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in rng["torch_cuda"]])
