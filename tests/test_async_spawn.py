"""The async strategy crosses torch.multiprocessing's spawn with explicit callbacks, under torch's default
sharing strategy (no ``set_sharing_strategy`` anywhere in the tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_hdet  # noqa: F401  (registers the strategies)
from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy, SlowRanks
from lightning_hdet.asynchronous.lightning.callback import AsyncLogging
from tests.helpers import LinearModel, Recorder, flat_params, load_ranks, trainer_kwargs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["async_local_sgd_spawn", "explicit"])
def test_spawn_with_explicit_callbacks_trains(tmp_path: Path, strategy: str) -> None:
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # torch's default on Linux
    seed_everything(0)
    model = LinearModel(n_train=64)
    initial = flat_params(model)
    if strategy == "explicit":
        strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(2), start_method="spawn")  # type: ignore[assignment]
    callbacks = [SlowRanks({1: 2.0}, base_seconds=0.01), AsyncLogging(), Recorder(tmp_path / "out"),
                 ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)]
    trainer = Trainer(strategy=strategy, callbacks=callbacks,
                      **trainer_kwargs(devices=2, max_steps=8, enable_checkpointing=True, default_root_dir=tmp_path))
    trainer.fit(model)
    ranks = load_ranks(tmp_path / "out", 2)
    final = ranks[0]["final_params"]
    assert torch.isfinite(final).all() and not torch.equal(final, initial)
    assert torch.equal(ranks[1]["final_params"], final)  # every rank ends with the global model
    # The budget (workers x max_steps inner steps) is spent exactly, however the two speeds split it.
    assert ranks[0]["global_step"] + ranks[1]["global_step"] == 2 * 8
    # A checkpoint written during training holds the steps done so far, consistently with each worker's count: rank
    # 0's step 4 or 8 falls at any point of the shared budget, even before the outer optimizer applied any push,
    # depending on how the two speeds and the local-step policy split it (seen: 0 of 16).
    during = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["async_local_sgd"]
    assert during["steps_done"] == sum(w["steps"] for w in during["workers"].values()) <= 2 * 8
    # the launching process's strategy holds rank 0's result (None there before): the whole budget, both workers
    result = trainer.strategy.result
    assert result is not None and result.steps_done == result.budget == 16 and sorted(result.workers) == [0, 1]
