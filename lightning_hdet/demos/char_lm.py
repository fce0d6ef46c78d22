"""A small causal Transformer language model over bytes, as a ``LightningModule``.

Sized for CPU benchmarks: the defaults (2 layers, width 64, context 64) run 100 steps in a few seconds
per process. Pre-norm encoder blocks with a causal mask; learned positional embeddings.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_hdet._checks import check_choice
from lightning_hdet.demos.base import DemoModule
from lightning_hdet.demos.corpus import VOCAB_SIZE
from lightning_hdet.demos.optim import OPTIMIZERS, make_optimizer

SCHEDULERS = ("constant", "cosine")


class CharLM(DemoModule):
    """Causal byte-level Transformer LM; logs ``train_loss`` every step and ``val_loss`` per validation.

    Args:
        vocab_size: number of token ids (256 for bytes).
        block_size: longest context the positional embedding covers.
        d_model: width; ``n_heads`` must divide it.
        n_layers: Transformer blocks.
        n_heads: attention heads per block.
        dropout: dropout inside the blocks.
        lr: learning rate (the base LR a scheduler scales).
        optimizer: ``"adamw"``, ``"sgd"`` (momentum 0.9), ``"prodigy"`` or ``"schedulefree"`` (AdamW; see
            :mod:`lightning_hdet.demos.optim`).
        weight_decay: decoupled for the Adam family, L2 for SGD.
        scheduler: ``"constant"`` or ``"cosine"`` (linear warm-up for ``warmup_steps``, then cosine decay
            to 10% of ``lr`` at the trainer's last step), stepped every optimizer step.
        warmup_steps: warm-up length for ``"cosine"``.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 64,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
        scheduler: str = "constant",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("scheduler", scheduler, SCHEDULERS)
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.save_hyperparameters()
        self.token_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits ``(batch, time, vocab)`` for a ``(batch, time)`` tensor of token ids."""
        t = tokens.shape[1]
        if t > self.hparams.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.hparams.block_size}")
        pos = torch.arange(t, device=tokens.device)
        h = self.token_emb(tokens) + self.pos_emb(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=h.dtype)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))

    def configure_optimizers(self):
        hp = self.hparams
        opt = make_optimizer(hp.optimizer, self.parameters(), hp.lr, hp.weight_decay)
        if hp.scheduler == "constant":
            return opt
        sched = warmup_cosine(opt, hp.warmup_steps, max(int(self.trainer.estimated_stepping_batches), 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``"cosine"`` schedule: a linear warm-up over ``warmup`` steps, then a cosine decay to 10 % of the lr at
    step ``total``, where it stays."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
