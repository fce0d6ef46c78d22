"""The PBT vote and the collapse-aware safety net inside real runs (multi-process on CPU with gloo)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import PBT, Best, HDETCallback, HDETStrategy, SafetyNet
from lightning_hdet.experimental import PB2
from tests.helpers import START, LinearModel, Recorder, Regression, load_ranks, trainer_kwargs

pytestmark = pytest.mark.timeout(600)
CLASSES = 10


def _fit(tmp_path: Path, model: LightningModule, strategy: HDETStrategy, callback: HDETCallback, devices: int,
         max_steps: int) -> list[dict[str, Any]]:
    seed_everything(0)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)],
                      **trainer_kwargs(devices=devices, max_steps=max_steps, use_distributed_sampler=False))
    trainer.fit(model)
    return load_ranks(tmp_path, devices)


def _grid_loss(lr: float, steps: int) -> float:
    """Plain SGD on the regression with the batches every rank sees (4 fixed batches of 64, in order)."""
    data, torch_state = Regression(), torch.get_rng_state()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    torch.set_rng_state(torch_state)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        i = torch.arange(64) + 64 * (s % 4)
        loss = torch.nn.functional.mse_loss(model(data.x[i]), data.y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(data.x), data.y))


def _winner_lr(rank: dict[str, Any]) -> float:
    last = max(h["step"] for h in rank["history"])
    rows = [h for h in rank["history"] if h["step"] == last]
    return rows[rows[0]["winner"]]["lr"]


@pytest.mark.parametrize("vote", ["pbt", "pb2", "best"])
def test_pbt_climbs_from_a_too_low_lr_where_best_stops(tmp_path, vote):
    """Least squares with SGD from an LR 50x below the best grid LR: every vote the highest LR has the lowest
    loss. PBT always keeps a group 1.2x above its leader, so it climbs to the good LRs, and so does PB2, whose bound
    reaches 1.2x above the population; ``best`` re-centres on the winner with a spread that shrinks to
    ``min_spread`` and stops far below them."""
    steps, start = 40, 0.002
    grid = {lr: _grid_loss(lr, steps) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 0.5)}
    best_grid = min(grid, key=grid.get)
    strategy = HDETStrategy(lr_multipliers=[0.5, 0.8, 1.25, 2.0], gradient_sync="group", start_method=START)
    rule = {"pbt": PBT(resample_probability=0.0), "pb2": PB2(), "best": Best(blend="best")}[vote]
    callback = HDETCallback(every_n_steps=2, vote=rule, search=False, seed=0)
    ranks = _fit(tmp_path, LinearModel(lr=start, batch_size=64), strategy, callback, devices=4, max_steps=steps)
    settled = _winner_lr(ranks[0])
    assert all(r["history"] == ranks[0]["history"] for r in ranks)
    if vote != "best":
        assert best_grid / 4 <= settled <= best_grid * 4
    else:
        assert settled < best_grid / 4


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
