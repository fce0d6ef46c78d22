"""Resuming the async strategy: synchronous DiLoCo resumes exactly; asynchronous runs land within tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hdet import AsyncLocalSGDStrategy
from tests.helpers import LinearModel, Recorder, Regression, load_ranks, trainer_kwargs

# Documented in docs/failure_modes.md: an asynchronous run resumed from a checkpoint ends within this relative
# distance of an uninterrupted run's final loss (the order of pushes differs, so it cannot be bit-exact).
ASYNC_RESUME_RTOL = 0.25


def _fit(out: Path, mode: str, max_steps: int, ckpt_path: str | None = None) -> list[dict[str, Any]]:
    seed_everything(0)
    # One batch, the same on every rank and every step: Lightning's data order on resume is not under test.
    model = LinearModel(lr=0.05, n_train=16)
    strategy = AsyncLocalSGDStrategy(local_steps=2, mode=mode, outer_lr=1.0, outer_momentum=0.5,
                                     dynamic_local_steps=False, start_method="spawn")
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=4)
    trainer = Trainer(strategy=strategy, callbacks=[ckpt, Recorder(out)],
                      **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=True,
                                       use_distributed_sampler=False))
    trainer.fit(model, ckpt_path=ckpt_path)
    return load_ranks(out, 2)


def _loss(params: torch.Tensor) -> float:
    data = Regression(n=16)
    return float(torch.nn.functional.mse_loss(data.x @ params[:8, None].float() + params[8].float(), data.y))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_matches_an_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    straight = _fit(tmp_path / "a", mode, 16)
    _fit(tmp_path / "b", mode, 8)
    resumed = _fit(tmp_path / "c", mode, 16, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    a, c = straight[0]["final_params"], resumed[0]["final_params"]
    assert all(torch.equal(r["final_params"], c) for r in resumed)  # every rank holds the global model
    if mode == "sync":
        torch.testing.assert_close(c, a, rtol=0, atol=1e-6)
    else:
        assert _loss(c) == pytest.approx(_loss(a), rel=ASYNC_RESUME_RTOL)
    assert _loss(c) < _loss(torch.zeros_like(c))  # and it trained
