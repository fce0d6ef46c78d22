"""The collapse-aware safety net inside a real run (multi-process on CPU with gloo). The vote rules on least squares
(PBT and PB2 climb from a too-low LR where ``best`` stops) run in one process: tests/test_fake_world.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import HDETCallback, HDETStrategy, SafetyNet
from tests.helpers import START, Recorder, load_ranks, trainer_kwargs

pytestmark = pytest.mark.timeout(600)
CLASSES = 10


def _fit(tmp_path: Path, model: LightningModule, strategy: HDETStrategy, callback: HDETCallback, devices: int,
         max_steps: int) -> list[dict[str, Any]]:
    seed_everything(0)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)],
                      **trainer_kwargs(devices=devices, max_steps=max_steps, use_distributed_sampler=False))
    trainer.fit(model)
    return load_ranks(tmp_path, devices)


class Clusters(LightningModule):
    """A ReLU MLP classifying 10 overlapping Gaussian clusters; AdamW at LR >= 1 kills its ReLUs and the loss sits
    at the constant predictor's ln(10) for good, without a NaN."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                       torch.nn.ReLU(), torch.nn.Linear(32, CLASSES))

    @staticmethod
    def data() -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(CLASSES, 8, generator=g)
        y = torch.arange(1024) % CLASSES
        return TensorDataset(centers[y] + torch.randn(1024, 8, generator=g), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data(), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(1))


def _full_loss(params: torch.Tensor) -> float:
    model = Clusters(lr=1.0)
    torch.nn.utils.vector_to_parameters(params.float(), model.parameters())
    x, y = Clusters.data().tensors
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model.net(x), y))


@pytest.mark.parametrize("net", ["collapse", "factor only"])
def test_collapse_without_nan_rolls_back_and_cuts_the_lrs(tmp_path, net):
    """AdamW at LRs 1 and 2: both groups sit at ln(10) with finite losses. The ratio rule (10x the best) never
    fires; the collapse rules (on by default) see every group knocked above its first-step loss and stuck there, roll
    every group back to the last good merge (here the initial model) and halve the LRs until training works."""
    safety_net = SafetyNet() if net == "collapse" else SafetyNet(stall_patience=None, rise_margin=None)  # ratio only
    callback = HDETCallback(every_n_steps=10, vote="best", safety_net=safety_net, search=False)
    strategy = HDETStrategy(lr_multipliers=[1.0, 2.0], gradient_sync="group", start_method=START)
    ranks = _fit(tmp_path, Clusters(lr=1.0), strategy, callback, devices=2, max_steps=150)
    final = _full_loss(ranks[0]["final_params"])
    lrs = ranks[0]["lr_multipliers"][:, 0].tolist()
    if net == "factor only":
        assert ranks[0]["rescues"] == 0 and final > 0.95 * math.log(CLASSES)  # collapsed, and nobody noticed
        return
    history = ranks[0]["history"]
    roll_backs = [s for s in sorted({h["step"] for h in history}) if all(h["rescued"] for h in history if h["step"] == s)]
    assert len(roll_backs) >= 2 and {h["reason"] for h in history if h["rescued"]} <= {"stalled", "rose"}
    assert ranks[0]["rescues"] == 2 * len(roll_backs)
    assert max(lrs) < 1.0  # every roll-back halved every LR
    assert math.isfinite(final) and final < 0.7 * math.log(CLASSES)  # trains again, far below the collapsed level
