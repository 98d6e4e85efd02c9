"""tiny_lm: a small decoder-only transformer with dropout, the reference training task.

It is deliberately plain PyTorch (``nn.TransformerEncoderLayer`` with a causal mask): what
perdure promises must hold for an ordinary model, not for one written around the runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from perdure.runtime.replica.task import Task


class TinyLM(nn.Module):
    """Token + position embeddings, a causal transformer stack, a tied output head."""

    def __init__(
        self,
        *,
        vocab: int = 256,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        max_len: int = 512,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        pos = torch.arange(n, device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.T


def init(name: str, module: nn.Module) -> bool:
    """The model's own initialisation, module by module (``task.init = "per_module"``):
    embeddings at std 0.02 as ``TinyLM.__init__`` draws them; the attention's input
    projection by its own (private) reset, and its output bias at zero as that reset
    sets it (a parent's writes to a child's parameters are dropped: each module's
    parameters are its own); everything else by its ``reset_parameters``."""
    if isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
        return True
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()  # its own reset, private in torch
        return True
    if name.endswith("self_attn.out_proj") and isinstance(module, nn.Linear):
        module.reset_parameters()
        if module.bias is not None:
            nn.init.zeros_(module.bias)
        return True
    return False


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of (per-sample mean token cross-entropy x sample weight).

    A sum, not a mean: perdure adds slot gradients in slot order and divides by the global
    batch once, so the result does not depend on how samples are grouped into calls.
    """
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return (ce.mean(dim=1) * batch["weight"]).sum()


def make_task(
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    dropout: float = 0.1,
    max_len: int = 512,
    vocab: int = 256,
) -> Task:
    """The task; ``vocab`` and ``max_len`` are declared on it so that the launcher's
    preflight can refuse a dataset whose tokens or samples this model cannot read."""
    model = TinyLM(
        vocab=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        dropout=dropout,
        max_len=max_len,
    )
    return Task(model=model, loss_fn=loss_fn, vocab_size=vocab, max_len=max_len, init=init)
