"""Floating-point buffers (BatchNorm running statistics) in AsyncLocalSGDStrategy: they travel with each push,
the global buffers are the mean of the workers' latest ones, and validation, checkpoints and the end of fit
use them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import AsyncLocalSGDStrategy
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.local_steps import LocalStepsPolicy
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.outer.state import AsyncStep
from lightning_hdet.asynchronous.wire.messages import Kind, Push
from benchmarks.common import adaptive_rounds
from tests.helpers import load_ranks, trainer_kwargs

OFFSET = 10.0  # rank r's inputs have mean r * OFFSET, so the workers' running means differ clearly


class BNModel(LightningModule):
    """BatchNorm1d then Linear; each rank trains on its own input distribution; validation logs the running
    mean."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4, momentum=0.5)
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.bn(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("bn_mean", self.bn.running_mean.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.trainer.global_rank)
        x = torch.randn(64, 4, generator=g) + OFFSET * self.trainer.global_rank
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def _bn_state(module: BNModel) -> torch.Tensor:
    return torch.cat([module.bn.running_mean, module.bn.running_var]).detach().clone()


class BNRecorder(Callback):
    """Per rank, by step: the buffers a push after that step carries, the local buffers after the step (and
    its possible exchange) and the validation metric; the buffers pulled first and at the end; rank 0 adds the
    outer state."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pushed: dict[int, torch.Tensor] = {}
        self.local: dict[int, torch.Tensor] = {}
        self.val: dict[int, float] = {}
        self.first: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.first is None:  # after the first exchange: what this worker pulled
            self.first = _bn_state(pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: Any, optimizer: Any) -> None:
        self.pushed[trainer.global_step + 1] = _bn_state(pl_module)  # the forward pass is done

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.local[trainer.global_step] = _bn_state(pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.val[trainer.global_step] = float(trainer.callback_metrics["bn_mean"])

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        outer = trainer.strategy._outer
        torch.save({"first": self.first, "pushed": self.pushed, "local": self.local, "val": self.val,
                    "final": _bn_state(pl_module),
                    "outer": outer.state_dict() if outer is not None else None},
                   self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, mode: str, ckpt_path: str | None = None) -> list[dict[str, Any]]:
    seed_everything(0)
    out.mkdir(parents=True)
    strategy = AsyncLocalSGDStrategy(local_steps=adaptive_rounds(2, mode), mode=mode, outer=DelayedNesterov(lr=1.0, momentum=0.0),
                                     start_method="fork")
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, save_top_k=-1)
    trainer = Trainer(strategy=strategy, callbacks=[ckpt, BNRecorder(out)],
                      **trainer_kwargs(devices=2, max_steps=8, enable_checkpointing=True,
                                       default_root_dir=out, use_distributed_sampler=False,
                                       limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=0))
    trainer.fit(BNModel(), ckpt_path=ckpt_path)
    return load_ranks(out, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_buffers_are_averaged_and_every_rank_ends_with_the_global_ones(tmp_path: Path, mode: str) -> None:
    ranks = _fit(tmp_path / "a", mode)
    outer = ranks[0]["outer"]
    # the workers' statistics differ clearly: each tracks its own inputs (both start a round from the same global
    # mean, and one forward pass at BatchNorm momentum 0.5 moves each halfway to its own inputs' mean, so they
    # are ~OFFSET / 2 apart after a one-step round, which dynamic local steps can give)
    pushed = [r["pushed"][max(r["pushed"])] for r in ranks]  # every step is pushed: the last one went last
    assert (pushed[1][:4] - pushed[0][:4]).min() > OFFSET / 4
    # the outer side kept each worker's latest buffers; the global ones are their mean
    for w in (0, 1):
        torch.testing.assert_close(outer["worker_buffers"][w], pushed[w], rtol=0, atol=0)
    torch.testing.assert_close(outer["buffers"], (pushed[0] + pushed[1]) / 2)
    # at the end of fit every rank holds the global buffers
    for r in ranks:
        torch.testing.assert_close(r["final"], outer["buffers"], rtol=0, atol=0)

    if mode == "async":
        # worker 1 continues from the global buffers: after an exchange (once worker 0 has pushed) its buffers
        # moved from its own statistics towards worker 0's (its forward passes only move them towards its own)
        assert any((pushed_own[:4] - ranks[1]["local"][step][:4]).min() > OFFSET / 4
                   for step, pushed_own in ranks[1]["pushed"].items())
        return  # below: checkpoint, validation and resume, exact in sync mode only (see below)

    # every worker continues from the global buffers: after the first round, the mean of both workers' buffers
    for r in ranks:
        torch.testing.assert_close(r["local"][2], (ranks[0]["pushed"][2] + ranks[1]["pushed"][2]) / 2)

    # A checkpoint written mid-round (step 3 of rounds of 2) holds the global buffers, not rank 0's own. The
    # outer state cannot change while rank 0 is within a round (every sync round waits for rank 0's push), so
    # the checkpoint and the validation at step 3 used exactly the outer state's global buffers: the mean of
    # both workers' buffers after the first round. (In async mode, another worker's push may come in between.)
    saved = torch.load(tmp_path / "a" / "ckpt" / "epoch=0-step=3.ckpt", weights_only=True)
    state = saved["async_local_sgd"]
    in_state_dict = torch.cat([saved["state_dict"]["bn.running_mean"], saved["state_dict"]["bn.running_var"]])
    assert set(state["worker_buffers"]) == {0, 1}
    torch.testing.assert_close(in_state_dict, state["buffers"], rtol=0, atol=0)
    # (the first round's pushes, not `worker_buffers`: worker 1 may have pushed its second round already, which the
    # outer state records on arrival and merges only when the round closes)
    mean = (ranks[0]["pushed"][2] + ranks[1]["pushed"][2]) / 2
    torch.testing.assert_close(state["buffers"], mean)
    assert (in_state_dict[:4] - ranks[0]["local"][3][:4]).abs().min() > 1.0  # rank 0's own differ
    assert ranks[0]["val"][3] == pytest.approx(float(state["buffers"][:4].mean()), abs=1e-5)
    assert abs(ranks[0]["val"][3] - float(ranks[0]["local"][3][:4].mean())) > 1.0

    # resume: every worker starts from the checkpoint's global buffers (the reply to its first message)
    resumed = _fit(tmp_path / "b", mode, ckpt_path=str(tmp_path / "a" / "ckpt" / "epoch=0-step=3.ckpt"))
    for r in resumed:
        torch.testing.assert_close(r["first"], state["buffers"], rtol=0, atol=0)
        torch.testing.assert_close(r["final"], resumed[0]["outer"]["buffers"], rtol=0, atol=0)


def _outer(buffers: torch.Tensor | None = None) -> OuterState:
    params = torch.zeros(3)
    opt = torch.optim.SGD([params], lr=1.0)
    extra = {} if buffers is None else {"buffers": buffers}
    return OuterState(params, opt, LocalStepsPolicy(4), AsyncStep(), None, **extra)


def _push(worker: int, g: float, buffers: list[float] | None) -> Push:
    values = None if buffers is None else torch.tensor(buffers)
    return Push(worker, Kind.PUSH, 4, 1.0, 0.0, torch.full((3,), g), buffers=values)


def test_outer_state_averages_the_workers_latest_buffers() -> None:
    outer = _outer(torch.tensor([5.0, 5.0]))  # rank 0's buffers at the start
    outer.process([_push(0, 1.0, [0.0, 2.0])])
    torch.testing.assert_close(outer.buffers, torch.tensor([0.0, 2.0]))  # only worker 0 has pushed
    outer.process([_push(1, 1.0, [4.0, 6.0])])
    torch.testing.assert_close(outer.buffers, torch.tensor([2.0, 4.0]))
    outer.process([_push(0, 1.0, [2.0, 2.0])])  # worker 0's newer values replace its older ones
    torch.testing.assert_close(outer.buffers, torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(outer.params, torch.full((3,), -3.0))  # the optimizer steps on parameters only

    # checkpoint round trip, including each worker's latest buffers
    state = outer.state_dict()
    restored = _outer(torch.zeros(2))
    restored.load_state_dict(state)
    torch.testing.assert_close(restored.buffers, torch.tensor([3.0, 4.0]))
    restored.process([_push(1, 0.0, [6.0, 8.0])])
    torch.testing.assert_close(restored.buffers, torch.tensor([4.0, 5.0]))  # worker 0's saved [2, 2] counts

    with pytest.raises(ValueError, match="3 floating-point buffer values but the model has 2"):
        _outer(torch.zeros(2)).load_state_dict({**state, "buffers": torch.zeros(3)})


def test_outer_state_without_buffers_is_unchanged() -> None:
    outer = _outer()
    outer.process([_push(0, 1.0, None), _push(1, 1.0, None)])
    assert outer.buffers.numel() == 0 and outer.worker_buffers == {}
    assert outer.state_dict()["buffers"].numel() == 0
