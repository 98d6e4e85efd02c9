"""hf_lm: a Hugging Face ``transformers`` GPT-2 causal LM trained by perdure.

What a user bringing a model written by others does: the model class is the library's
own (``GPT2LMHeadModel``), built from a ``GPT2Config`` made in code with random weights
(seeded by perdure before the factory runs, so every replica builds the same ones). No
download and no network: ``HF_HUB_OFFLINE`` is set before ``transformers`` is imported,
and nothing is read from the hub. Dropout is on (embeddings, residuals, attention), and
perdure's per-(step, slot) seeding makes it the same on any worker.

``transformers`` is an optional dependency (``pip install perdure[hf]``); importing it
costs seconds, which the local launcher's zygote pays once for every worker
(``cluster.preload_task``). Byte-level datasets (``perdure data build``) have 256 token
ids: ``vocab_size`` and ``max_len`` are declared on the Task so that preflight refuses a
dataset the model cannot read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from perdure.runtime.replica.task import Task


def model_config(
    *, vocab: int, max_len: int, d_model: int, n_layers: int, n_heads: int, dropout: float
) -> GPT2Config:
    """A small GPT-2 configuration, in code (no ``from_pretrained``)."""
    return GPT2Config(
        vocab_size=vocab,
        n_positions=max_len,
        n_embd=d_model,
        n_layer=n_layers,
        n_head=n_heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=None,
        eos_token_id=None,
        # the library's reference attention: its bits do not depend on which fused SDPA
        # kernel a machine picks
        attn_implementation="eager",
    )


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of (per-sample mean next-token cross-entropy x sample weight).

    The library's own ``labels=`` loss is a mean over the batch's tokens; perdure needs a
    sum over samples (it divides the slot-ordered gradient sum by the global batch once),
    so the loss is computed from the logits here."""
    tokens = batch["tokens"]
    logits = model(input_ids=tokens[:, :-1]).logits
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return (ce.mean(dim=1) * batch["weight"]).sum()


def per_module_init(model: GPT2LMHeadModel) -> Callable[[str, nn.Module], bool]:
    """``Task.init`` for ``task.init = "per_module"``: the library's own initialisation,
    one module at a time. ``_init_weights(module)`` is what ``post_init`` applies to each
    module (weights at ``initializer_range``, biases zero, LayerNorm ones). GPT-2's scaled
    initialisation of the residual projections (``c_proj``, std / sqrt(2 layers)) is
    applied by the library from their parents, whose writes to a child's parameters are
    dropped when each module initialises alone; so it is done here on the ``c_proj``
    module itself. The same distributions as eager construction, other draws."""
    scaled = model.config.initializer_range / math.sqrt(2 * model.config.n_layer)

    def init(name: str, module: nn.Module) -> bool:
        model._init_weights(module)
        if name.endswith((".attn.c_proj", ".mlp.c_proj")):
            nn.init.normal_(module.weight, mean=0.0, std=scaled)
        return True

    return init


def make_task(
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    dropout: float = 0.1,
    max_len: int = 256,
    vocab: int = 256,
) -> Task:
    """The task: a randomly initialised ``GPT2LMHeadModel`` in training mode."""
    cfg = model_config(
        vocab=vocab,
        max_len=max_len,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        dropout=dropout,
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    return Task(
        model=model,
        loss_fn=loss_fn,
        vocab_size=vocab,
        max_len=max_len,
        init=per_module_init(model),
    )
