"""Validation under HDET describes the model a checkpoint holds (lightning_hdet/hdet/execution/validation.py); the
sharded swap's arithmetic is tested in tests/test_hdet_fsdp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.hdet.lightning.checkpoints import group_file
from tests.helpers import START, LinearModel, Regression, trainer_kwargs

pytestmark = pytest.mark.timeout(300)


class SyncedLinear(LinearModel):
    """``val_loss`` averaged over all ranks (each holds a quarter of the 64 items: no sampler padding), so the
    monitored value is the whole validation set's loss, which one plain process can check."""

    def validation_step(self, batch, batch_idx) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=64, seed=1), batch_size=16)

    def test_step(self, batch, batch_idx) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    test_dataloader = val_dataloader


class ResultProbe(Callback):
    """Writes rank 0's ``HDETCallback.result`` (set in the HDET callback's ``on_fit_end``, which runs first)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            hdet = next(cb for cb in trainer.callbacks if isinstance(cb, HDETCallback))
            torch.save(hdet.result, self.out / "result.pt")


def test_model_checkpoint_keeps_the_best_model_by_its_own_validation_loss(tmp_path: Path) -> None:
    """Four groups 0.3x-10x apart, each training on its own: ModelCheckpoint(monitor="val_loss", save_top_k=1)'s
    best score is the saved file's own validation loss, read back by plain Lightning in one process."""
    seed_everything(0)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1)
    strategy = HDETStrategy(lr_multipliers=[0.3, 1.0, 3.0, 10.0], gradient_sync="group", start_method=START)
    # (monitor=None: validation runs the merged model; "auto" would vote on each group's own val_loss here, the data
    # repeating, and say so: test_auto_monitor_fit)
    callbacks = [HDETCallback(every_n_steps=100, monitor=None), ResultProbe(tmp_path), checkpoint]
    trainer = Trainer(strategy=strategy, callbacks=callbacks,
                      **trainer_kwargs(max_steps=8, val_check_interval=2, limit_val_batches=None,
                                       num_sanity_val_steps=0, enable_checkpointing=True))
    trainer.fit(SyncedLinear(lr=0.02))
    saved = torch.load(checkpoint.best_model_path, weights_only=False)
    monitored = next(v["best_model_score"] for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    plain = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
    [validated] = plain.validate(SyncedLinear.load_from_checkpoint(checkpoint.best_model_path), verbose=False)
    assert float(monitored) == pytest.approx(validated["val_loss"], rel=1e-5)
    # each group wrote its own state beside it (swapped back before ModelCheckpoint saved), whose mean is the file's
    own = [torch.load(group_file(checkpoint.best_model_path, g), weights_only=True)["state_dict"] for g in range(4)]
    assert not torch.allclose(own[0]["layer.weight"], own[3]["layer.weight"])
    for key, merged in saved["state_dict"].items():
        torch.testing.assert_close(sum(o[key] for o in own) / 4, merged)
    # testing the best checkpoint: every group reads its own file back, and the test sees the merged model too
    [tested] = trainer.test(ckpt_path="best", verbose=False)
    assert tested["test_loss"] == pytest.approx(validated["val_loss"], rel=1e-5)
    # what the run hands back: no vote in 8 steps, the final merge's winner, the LRs the groups started at
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result.votes == 0 and result.rescues == 0 and [s for s, _ in result.winners] == [8]
    assert result.initial_lrs == pytest.approx([0.006, 0.02, 0.06, 0.2])
    assert result.lrs == result.group_lrs[result.winners[0][1]] and result.vote_history == []  # no logger
    assert "no vote in 8 step(s) (a vote every 100 steps): no LR moved, so the run was one plain DDP run per " \
           "group" in result.summary()
    assert [(r["step"], r["group"]) for r in result.to_rows()] == [(8, g) for g in range(4)]  # the final merge
