"""``HDETCallback(monitor="auto")``'s decision (lightning_hdet/hdet/lightning/auto_monitor.py): the rule in one
process, and in a two-process fit."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.hdet.lightning.auto_monitor import (AUTO_METRIC, MAX_WAIT, choose, epochs_read,
                                                        validation_period, warn_readers)
from tests.helpers import START, LinearModel, quiet_trainer, trainer_kwargs


def test_epochs_read_is_the_run_over_one_epoch_and_unknown_without_either() -> None:
    assert epochs_read(300, 8.0) == pytest.approx(37.5)
    assert epochs_read(None, 8.0) is None and epochs_read(300, None) is None
    assert epochs_read(300, float("inf")) is None and epochs_read(300, 0.0) is None


def test_a_run_that_reads_its_data_once_votes_on_the_training_loss_and_says_nothing() -> None:
    assert choose(1.0, 10.0, 20) == (None, "")
    assert choose(0.3, 10.0, 20) == (None, "")
    assert choose(None, 10.0, 20) == (None, "")


def test_a_repeating_run_that_validates_often_enough_votes_on_val_loss() -> None:
    name, line = choose(37.5, 19.0, 38)
    assert name == AUTO_METRIC and "reads its training data 37.5 times" in line and "monitor=None" in line
    name, _ = choose(4.0, MAX_WAIT * 38, 38)  # a validation every two intervals: still read
    assert name == AUTO_METRIC


def test_a_repeating_run_without_usable_validation_warns_with_the_fix() -> None:
    name, line = choose(4.0, None, 38)
    assert name is None and "Pass validation data and log `val_loss`" in line and "monitor='your_metric'" in line
    name, line = choose(4.0, MAX_WAIT * 38 + 1, 38)  # validating too rarely: the votes would wait
    assert name is None and "Validate at least every 76 steps (now every 77" in line
    assert "val_check_interval=38, check_val_every_n_epoch=None" in line


class _Period(Callback):
    """What :func:`validation_period` reads of the fit at train start."""

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.period = validation_period(trainer)


def test_a_validation_step_without_validation_data_is_no_validation() -> None:
    """Lightning skips the val loop of a module with a ``validation_step`` but no validation data: "auto" must not
    wait for a ``val_loss`` that never comes (it did: every vote waited, and the run failed at its end)."""
    model = LinearModel(n_train=64)  # 4 batches of 16
    periods = []
    for val in (None, model.val_dataloader()):
        seen = _Period()
        quiet_trainer(max_steps=1, callbacks=[seen], val_check_interval=2).fit(
            _TrainDataOnly(), train_dataloaders=model.train_dataloader(), val_dataloaders=val)
        periods.append(seen.period)
    assert periods == [None, 2.0]


def _readers_warnings(callbacks: list[Callback], num_groups: int = 4) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_readers(SimpleNamespace(callbacks=callbacks), num_groups, "val_loss")
    return [str(w.message) for w in caught]


def test_callbacks_that_keep_or_stop_on_the_voted_metric_are_warned_about_by_name() -> None:
    """Validation runs each group's own model while the votes read ``val_loss``: a ModelCheckpoint or EarlyStopping
    on it would keep or stop on a group's value, and the warning names them and the fix."""
    [message] = _readers_warnings([ModelCheckpoint(monitor="val_loss"), EarlyStopping(monitor="val_loss"),
                                   ModelCheckpoint(monitor="train_loss")])
    assert "ModelCheckpoint(monitor='val_loss') and EarlyStopping(monitor='val_loss') see a group's value" in message
    assert "HDETCallback(monitor=None)" in message and "train_loss" not in message


def test_nothing_reading_the_voted_metric_means_no_warning() -> None:
    """The demo's case (no checkpointing, or Lightning's default ModelCheckpoint, which monitors nothing): nothing
    acts on a group's value, so there is nothing to say (the warning there told the user nothing to do)."""
    assert _readers_warnings([]) == []
    assert _readers_warnings([ModelCheckpoint()]) == []
    assert _readers_warnings([EarlyStopping(monitor="val_loss")], num_groups=1) == []  # one group: the merged model


class _Validated(Callback):
    """Each rank's ``val_loss`` at every validation, and the callback's result, written at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out, self.seen = out, {}

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.seen[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        hdet = next(cb for cb in trainer.callbacks if isinstance(cb, HDETCallback))
        torch.save({"seen": self.seen, "history": hdet.history, "monitor": hdet.result.monitor,
                    "summary": hdet.result.summary(), "every": hdet.result.every_n_steps,
                    "config": hdet.config["every_n_steps"]}, self.out / f"validated{trainer.global_rank}.pt")


def _fit(out: Path, every: Optional[int] = 4, steps: int = 16, **trainer: Any) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    seed_everything(0)
    fit = Trainer(strategy=HDETStrategy(start_method=START),
                  callbacks=[HDETCallback(every_n_steps=every), _Validated(out)],
                  **trainer_kwargs(devices=2, max_steps=steps, **trainer))
    fit.fit(LinearModel(lr=0.02, n_train=64))  # 2 steps an epoch on each of two ranks: 8 epochs in 16 steps
    return [torch.load(out / f"validated{r}.pt", weights_only=False) for r in range(2)]


def test_a_repeating_run_that_validates_votes_on_each_groups_val_loss(tmp_path: Path) -> None:
    """Two processes, two groups of one rank, the data read 8 times, validation every 4 steps: every vote's loss for
    group g is rank g's own ``val_loss`` of that step (each group validates its own model), and the result says so.
    The same run without validation votes on the training loss, the summary saying so."""
    ranks = _fit(tmp_path / "val", val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=None)
    assert all(r["monitor"] == "val_loss" for r in ranks)
    votes = sorted({h["step"] for h in ranks[0]["history"]})
    assert votes == [4, 8, 12, 16]
    for h in ranks[0]["history"]:
        assert h["loss"] == pytest.approx(ranks[h["group"]]["seen"][h["step"]], rel=1e-6)
    assert ranks[0]["seen"][4] != pytest.approx(ranks[1]["seen"][4])  # two models, two values
    assert "the votes read each group's `val_loss`" in ranks[0]["summary"]
    plain = _fit(tmp_path / "plain")  # limit_val_batches=0: no validation
    assert plain[0]["monitor"] is None and plain[0]["seen"] == {}
    assert "the votes read each group's training loss" in plain[0]["summary"]


def test_a_sized_interval_votes_on_the_validation_grid_a_given_one_as_written(tmp_path: Path) -> None:
    """64 steps size the votes 8 apart (64 / 4 / 2); validation every 6 steps moves them to every 6 from step 12 (none
    before the sized interval), each reading that step's validation, and the result and run config say 6.
    ``every_n_steps=8`` given stays 8: its votes wait for the next validation (12, 18, 24, 36, ...)."""
    grid = dict(val_check_interval=6, check_val_every_n_epoch=None, limit_val_batches=None)
    ranks = _fit(tmp_path / "sized", every=None, steps=64, **grid)
    assert ranks[0]["monitor"] == "val_loss" and ranks[0]["every"] == ranks[0]["config"] == 6
    assert sorted({h["step"] for h in ranks[0]["history"]}) == list(range(12, 61, 6)) + [64]  # 64: the final merge
    for h in ranks[0]["history"]:
        if h["step"] != 64:
            assert h["loss"] == pytest.approx(ranks[h["group"]]["seen"][h["step"]], rel=1e-6)
    given = _fit(tmp_path / "given", every=8, steps=64, **grid)
    assert given[0]["every"] == given[0]["config"] == 8
    assert sorted({h["step"] for h in given[0]["history"]}) == [12, 18, 24, 36, 42, 48, 60, 64]


class _TrainDataOnly(LightningModule):
    """A module with a ``validation_step`` and no data hooks: the fit is given the data (validation data or none)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _OtherName(LinearModel):
    """Validation logs ``valid_loss``, not ``val_loss``."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("valid_loss", torch.nn.functional.mse_loss(self.layer(x), y))


def test_a_validation_without_val_loss_falls_back_to_the_training_loss(tmp_path: Path) -> None:
    """"auto" chose ``val_loss`` (the data repeat, validation every 4 steps), but validation logs ``valid_loss``:
    at the first validation the votes fall back to the training loss, the waiting vote runs then, and every later
    vote falls on its own step."""
    (tmp_path / "x").mkdir()
    seed_everything(0)
    fit = Trainer(strategy=HDETStrategy(start_method=START), callbacks=[HDETCallback(every_n_steps=4),
                  _Validated(tmp_path / "x")], **trainer_kwargs(devices=2, max_steps=16, val_check_interval=4,
                                                                check_val_every_n_epoch=None, limit_val_batches=None))
    fit.fit(_OtherName(lr=0.02, n_train=64))
    rank = torch.load(tmp_path / "x" / "validated0.pt", weights_only=False)
    assert rank["monitor"] is None and rank["seen"] == {}
    assert sorted({h["step"] for h in rank["history"]}) == [4, 8, 12, 16]
    assert "the votes read each group's training loss" in rank["summary"]
