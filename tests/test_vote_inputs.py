"""What a vote reads: a monitored metric at the right validation and each group's own value (sync_dist, ties), the
per-step loss under gradient accumulation, a module whose votes would read nothing refused before it trains.

One process against :class:`lightning_hdet.testing.FakeWorld` where the rule does not depend on processes (values by
hand); several gloo processes through Lightning's Trainer where it does (Lightning's own reduction, its loss
scaling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.hdet.lightning.checkpoints import group_file
from lightning_hdet.hdet.lightning.module_checks import check_module, returns_a_value, stepping_warning
from lightning_hdet.testing import FakeWorld
from tests.helpers import START, LinearModel, Recorder, Regression, SGDBoring, load_ranks, trainer_kwargs

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------------ one process, by hand
def _drift(same: bool = False):
    """A training step: group ``g``'s parameter grows by ``g + 1`` (by 1 for every group when ``same``)."""

    def step(executor, index):
        executor.params.add_(1 if same else executor.group_index + 1)
        return 1.0

    return step


def _validation(every: int, value=lambda g, step: step + g / 10):
    """A validation every ``every`` steps logging ``val_loss = value(group, step)``."""
    return lambda executor, step: {"val_loss": value(executor.group_index, step)} if step % every == 0 else None


def _monitored(**kw):
    return lambda: HDETCallback(monitor="val_loss", search=False, **kw)


def _votes(callback) -> dict[int, list[float]]:
    steps: dict[int, list[float]] = {}
    for row in callback.history:
        steps.setdefault(row["step"], []).append(row["loss"])
    return steps


def test_a_vote_reads_the_validation_of_its_own_step() -> None:
    """Validating every 2 steps and voting every 4: each vote reads the validation of its step (4 and 8), not the
    one before it (Lightning validates after the step's ``on_train_batch_end``, where the vote falls due)."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_monitored(every_n_steps=4), _drift(), max_steps=8, validate=_validation(2))
    assert _votes(cb) == {4: pytest.approx([4.0, 4.1]), 8: pytest.approx([8.0, 8.1])}


def test_a_vote_waits_for_the_next_validation_and_the_run_end_votes_on_the_last() -> None:
    """Validating every 3 steps and voting every 4: the vote due at 4 waits for step 6's validation; the one due at
    8 finds none before the run ends and the final vote reads step 6's values."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_monitored(every_n_steps=4), _drift(), max_steps=8, validate=_validation(3))
    assert _votes(cb) == {6: pytest.approx([6.0, 6.1]), 8: pytest.approx([6.0, 6.1])}
    assert cb.num_votes == 1  # the final merge is no vote


def test_one_value_for_groups_that_differ_is_reported_and_counted() -> None:
    """Every group logging the same value (a metric synced over the whole job) while their parameters differ: each
    such vote warns, naming sync_dist and the fix, and is counted; groups holding one model may agree."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    with pytest.warns(UserWarning, match=r"vote at step 4: every group reported val_loss=1\.5 although the groups' "
                                         r"parameters differ.*sync_dist=True"):
        (cb, _), _ = world.fit(_monitored(every_n_steps=4), _drift(), max_steps=8,
                               validate=_validation(4, lambda g, step: 1.5))
    assert cb.ties == 2 and _votes(cb) == {4: [1.5, 1.5], 8: [1.5, 1.5]}
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_monitored(every_n_steps=4), _drift(same=True), max_steps=8,
                           validate=_validation(4, lambda g, step: 1.5))
    assert cb.ties == 0


def test_the_voted_loss_is_the_per_step_loss_under_accumulation() -> None:
    """Lightning hands ``on_train_batch_end`` the loss divided by ``accumulate_grad_batches``; the vote multiplies it
    back (group g's loss 1 + g every step: the votes read 1 and 2, not 0.5 and 1)."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)

    def step(executor, index):
        return (1.0 + executor.group_index) / 2  # what Lightning hands over with accumulate_grad_batches=2

    (cb, _), _ = world.fit(lambda: HDETCallback(every_n_steps=4, search=False), step, max_steps=4,
                           accumulate_grad_batches=2)
    assert _votes(cb) == {4: pytest.approx([1.0, 2.0])}


class _Manual(SGDBoring):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.step(batch)
        self.manual_backward(loss)
        opt.step()
        return loss


class _ManualSilent(_Manual):
    def training_step(self, batch: Any, batch_idx: int) -> None:
        def closure():  # a nested return is not the step's
            return self.step(batch)

        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(closure())
        opt.step()


def test_a_manual_module_that_returns_no_loss_is_refused_before_it_trains() -> None:
    assert returns_a_value(_Manual.training_step) is True and returns_a_value(_ManualSilent.training_step) is False
    assert returns_a_value(len) is None  # no source: the first step tells
    with pytest.raises(MisconfigurationException, match=r"_ManualSilent uses manual optimization and its "
                                                        r"`training_step` returns nothing\. Return the loss"):
        check_module(_ManualSilent(), monitor=None)
    check_module(_ManualSilent(), monitor="val_loss")  # the vote reads a validation metric
    check_module(_Manual(), monitor=None)
    with pytest.warns(UserWarning, match="needs several data-parallel replicas"):
        trainer = Trainer(strategy=HDETStrategy(), callbacks=[HDETCallback(every_n_steps=2)],
                          **trainer_kwargs(devices=1, max_steps=4))
    with pytest.raises(MisconfigurationException, match="returns nothing"):
        trainer.fit(_ManualSilent())
    assert trainer.global_step == 0  # refused at setup, before the first step


def test_several_optimizers_warn_when_votes_would_fall_less_often_than_asked() -> None:
    """Two optimizers stepping each batch move ``global_step`` by 2: votes every 3 steps would fall every 6."""
    warning = stepping_warning(_Manual(), num_optimizers=2, every_n_steps=3)
    assert warning is not None and "every 6 steps (3 batches)" in warning
    assert "e.g. 6: a vote every 3 batches" in warning
    assert stepping_warning(_Manual(), num_optimizers=2, every_n_steps=4) is None  # falls on every second batch
    assert stepping_warning(SGDBoring(), num_optimizers=2, every_n_steps=3) is None  # automatic: one step a batch
    assert stepping_warning(_Manual(), num_optimizers=1, every_n_steps=3) is None


# ------------------------------------------------------------------------------------------ several processes
class _GroupValidated(LinearModel):
    """``val_loss`` logged with ``sync_dist=True``, or as a torchmetrics ``MeanMetric`` left at its default
    ``process_group`` (``metric=True``); each rank keeps its own (unsynced) value per validation step."""

    def __init__(self, out: str, metric: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.val_metric = torchmetrics.MeanMetric() if metric else None
        self.own: list[tuple[int, float]] = []
        self.train_losses: list[tuple[int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.train_losses.append((self.trainer.global_step, float(loss)))  # before the step: it ends at global_step + 1
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if not self.trainer.sanity_checking:
            self.own.append((self.trainer.global_step, float(loss)))
        if self.val_metric is None:
            self.log("val_loss", loss, sync_dist=True)
        else:
            self.val_metric.update(loss)
            self.log("val_loss", self.val_metric)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=64, seed=1), batch_size=16)  # two batches per rank of a group of 2: no padding

    def on_fit_end(self) -> None:
        synced = None if self.val_metric is None else self.val_metric.process_group
        torch.save({"own": self.own, "train": self.train_losses, "synced": synced},
                   Path(self.out) / f"model{self.global_rank}.pt")


@pytest.mark.parametrize("metric", [False, True], ids=["sync_dist", "torchmetrics"])
def test_a_synced_metric_is_each_groups_own_and_a_vote_at_a_validation_step_reads_it(tmp_path: Path,
                                                                                      metric: bool) -> None:
    """4 ranks in 2 groups, ``self.log("val_loss", sync_dist=True)`` or a torchmetrics ``MeanMetric`` with no
    ``process_group`` (which synced over all four ranks: every vote a tie), validating and voting every 4 steps
    (which crashed: the vote ran before the step's validation). Each vote reads that step's validation, reduced
    inside each group: group g's value is the mean of its two ranks' own losses, and the groups' values differ; the
    metric syncs over every rank again after the fit."""
    seed_everything(0)
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[0.2, 5.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=4, monitor="val_loss", search=False)
    # named by the metric, which now differs between groups: every group's own file goes beside rank 0's checkpoint
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", filename="{step}-{val_loss:.6f}",
                                 save_top_k=-1)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path), checkpoint],
                      **trainer_kwargs(devices=4, max_steps=8, val_check_interval=4, limit_val_batches=None,
                                       num_sanity_val_steps=0, enable_checkpointing=True))
    trainer.fit(_GroupValidated(str(tmp_path), metric=metric, lr=0.05))
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(saved) == 2 and all(Path(group_file(path, g)).exists() for path in saved for g in range(2)), \
        sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "ckpt").rglob("*"))
    ranks = load_ranks(tmp_path, 4)
    records = [torch.load(tmp_path / f"model{r}.pt", weights_only=False) for r in range(4)]
    assert [r["synced"] for r in records] == [None] * 4  # the metric's own default again
    own = [_per_step_means(r["own"]) for r in records]
    history = ranks[0]["history"]
    assert sorted({h["step"] for h in history}) == [4, 8]
    for step in (4, 8):
        voted = [h["loss"] for h in history if h["step"] == step]
        expected = [(own[0][step] + own[1][step]) / 2, (own[2][step] + own[3][step]) / 2]
        assert voted == pytest.approx(expected, rel=1e-6)
        assert abs(voted[0] - voted[1]) > 1e-3 * abs(voted[0])  # not one job-wide value
    assert all(r["history"] == history for r in ranks)


def _per_step_means(values: list[tuple[int, float]]) -> dict[int, float]:
    """A rank's validation losses averaged per step (equal batches: what Lightning logs for the epoch)."""
    steps: dict[int, list[float]] = {}
    for step, value in values:
        steps.setdefault(step, []).append(value)
    return {step: sum(v) / len(v) for step, v in steps.items()}


class _IndexedValidated(LinearModel):
    """Records which items each rank trains and validates on (every item carries its index)."""

    def __init__(self, out: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.out = out
        self.seen: dict[str, list[int]] = {"train": [], "val": []}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen["train"] += index.tolist()
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        if not self.trainer.sanity_checking:
            self.seen["val"] += index.tolist()
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_indexed(Regression(n=128)), batch_size=8)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_indexed(Regression(n=32, seed=1)), batch_size=8)

    def on_fit_end(self) -> None:
        torch.save(self.seen, Path(self.out) / f"seen{self.global_rank}.pt")


def _indexed(data: Regression) -> TensorDataset:
    return TensorDataset(data.x, data.y, torch.arange(len(data)))


@pytest.mark.parametrize("monitor", ["val_loss", None])
def test_under_a_validation_vote_every_group_validates_the_same_data_and_training_stays_split(
        tmp_path: Path, monitor: str | None) -> None:
    """4 ranks in 2 groups, Lightning's own distributed sampler. Votes on ``val_loss``: the fit's validation is
    split over each group's two ranks, so both groups validate all 32 items (each rank 16; Lightning split them over
    all four ranks, 8 each, so the groups were measured on different items). Training data stay split over the
    four ranks (no item twice in a step). Votes on the training loss: validation as Lightning splits it."""
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[0.5, 2.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=4, monitor=monitor, search=False)
    trainer = Trainer(strategy=strategy, callbacks=[callback],
                      **trainer_kwargs(devices=4, max_steps=4, val_check_interval=4, limit_val_batches=None,
                                       num_sanity_val_steps=1))
    trainer.fit(_IndexedValidated(str(tmp_path)))
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(4)]
    train = [index for rank in seen for index in rank["train"]]
    assert sorted(train) == list(range(128))  # 4 steps x 8 items x 4 ranks: each item once
    groups = [sorted(seen[r]["val"] + seen[r + 1]["val"]) for r in (0, 2)]
    if monitor is None:
        assert sorted(groups[0] + groups[1]) == list(range(32))  # each group its own half
    else:
        assert groups[0] == groups[1] == list(range(32))
        assert len(seen[0]["val"]) == 16 and not set(seen[0]["val"]) & set(seen[1]["val"])


def test_the_voted_loss_under_accumulation_is_the_per_step_loss(tmp_path: Path) -> None:
    """``accumulate_grad_batches=2`` on 2 ranks (one group each): each vote's loss is the mean of the group's own
    ``training_step`` losses over the interval (Lightning halves what it hands the callbacks)."""
    seed_everything(0)
    strategy = HDETStrategy(lr_multipliers=[0.5, 2.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=4, search=False)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)],
                      **trainer_kwargs(devices=2, max_steps=8, accumulate_grad_batches=2))
    trainer.fit(_GroupValidated(str(tmp_path), lr=0.05))
    history = load_ranks(tmp_path, 2)[0]["history"]
    for rank in range(2):
        train = torch.load(tmp_path / f"model{rank}.pt")["train"]
        first = [loss for step, loss in train if step < 4]  # the 8 batches of steps 1-4
        assert len(first) == 8
        voted = next(h["loss"] for h in history if h["step"] == 4 and h["group"] == rank)
        assert voted == pytest.approx(sum(first) / len(first), rel=1e-6)


class _TwoOptimizers(SGDBoring):
    """Manual optimization with two optimizers (weight, bias), both stepping every batch; records each step's LRs."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.seen: list[tuple[float, float]] = []

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.SGD([self.layer.bias], lr=0.01)]

    def on_train_start(self) -> None:
        self.lrs: list[float] = []  # the LR each optimizer step really used
        for opt in self.optimizers():
            opt.optimizer.register_step_pre_hook(lambda o, a, k: self.lrs.append(o.param_groups[0]["lr"]))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()
        self.seen.append(tuple(self.lrs[-2:]))
        return loss

    def on_fit_end(self) -> None:
        torch.save(self.seen, Path(self.trainer.default_root_dir) / f"seen{self.global_rank}.pt")


def test_several_optimizers_under_manual_optimization_take_the_groups_multipliers(tmp_path: Path) -> None:
    """Both optimizers step at the group's multiplier times their own LR; ``global_step`` moves by 2 a batch, so
    votes every 4 steps fall every 2 batches."""
    strategy = HDETStrategy(lr_multipliers=[0.5, 2.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=4, search=False, vote="best")
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)], default_root_dir=tmp_path,
                      **trainer_kwargs(devices=2, max_steps=8))
    trainer.fit(_TwoOptimizers())
    ranks = load_ranks(tmp_path, 2)
    assert sorted({h["step"] for h in ranks[0]["history"]}) == [4, 8]
    for rank in range(2):
        seen = torch.load(tmp_path / f"seen{rank}.pt")
        assert len(seen) == 4  # 4 batches, 2 optimizer steps each
        assert seen[0] == pytest.approx((0.1 * (0.5, 2.0)[rank], 0.01 * (0.5, 2.0)[rank]))
    assert ranks[0]["lr_multipliers"].shape == (2, 2)  # one column per param group of either optimizer
