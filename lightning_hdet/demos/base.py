"""What the demo models share: loss logging per step and per validation, and schedule-free weight swaps."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_hdet._checks import is_int, require
from lightning_hdet.demos.optim import make_optimizer, set_schedule_free_mode, with_schedule


def check_shuffle_seed(shuffle_seed: object) -> None:
    """A datamodule's ``shuffle_seed`` argument: an int or ``None`` (checked when the datamodule is made)."""
    require("shuffle_seed", shuffle_seed, shuffle_seed is None or is_int(shuffle_seed), "an int or None",
            "None follows the global seed; an int fixes the training order.")


def shuffle_generator(shuffle_seed: int | None) -> torch.Generator | None:
    """The training ``DataLoader``'s shuffle: ``None`` follows the global seed (as any ``DataLoader``); an int
    gives one fixed order, the same in a one-process run and in every rank of a launched job (whose global RNG
    is re-seeded after the model was built, so its order would differ). Lightning's ``DistributedSampler``
    (sharded data) ignores it. Made per fit: a generator cannot cross a spawn."""
    return None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)


def check_shard_train(shard_train: object) -> None:
    """A datamodule's ``shard_train`` argument: a bool."""
    require("shard_train", shard_train, isinstance(shard_train, bool), "True or False",
            "True gives every rank its own shard of the training set and the whole validation set "
            "(with Trainer(use_distributed_sampler=False)).")


def training_loader(
    dataset: Dataset, batch_size: int, shuffle_seed: int | None, shard_train: bool, trainer: Trainer | None,
    num_workers: int = 0,
) -> DataLoader:
    """The shuffled training ``DataLoader`` of a demo datamodule.

    ``shard_train`` with more than one process: rank r reads its own shard, as under Lightning's
    ``DistributedSampler``, but made here, so that ``Trainer(use_distributed_sampler=False)`` leaves the
    validation set whole on every rank. HDET's groups under ``gradient_sync="global"`` then average the whole
    job's batch every step and still validate on the same batches, so their losses compare. Every rank must use
    the same ``shuffle_seed`` (``None``: 0, the sampler's default) or the shards would overlap."""
    if shard_train and trainer is not None and trainer.world_size > 1:
        sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                     shuffle=True, seed=0 if shuffle_seed is None else shuffle_seed, drop_last=True)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=num_workers,
                      generator=shuffle_generator(shuffle_seed))


class DemoModule(LightningModule):
    """Base of the demo models (cross-entropy of ``self(inputs)`` against the targets; the optimizer and schedule
    named by the hparams ``optimizer``, ``lr``, ``weight_decay`` and ``scheduler``): logs ``train_loss`` every step and
    ``val_loss`` per validation (unsynchronised: each rank keeps its own value, of the merged model under HDET, or of
    its own group's with ``HDETCallback(monitor="val_loss")``, the vote's signal),
    and lets a schedule-free optimizer train on its interpolated weights and validate on its average
    (``optimizer.train()`` / ``optimizer.eval()``; a no-op for every other optimizer)."""

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Cross-entropy of the logits ``self(inputs)`` against ``targets``, over every position (a classifier's
        ``(batch, classes)`` or a language model's ``(batch, time, vocabulary)``)."""
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @override
    def configure_optimizers(self) -> object:
        hp = self.hparams
        optimizer = make_optimizer(hp.optimizer, self.parameters(), hp.lr, hp.weight_decay)
        return with_schedule(optimizer, hp.scheduler, self)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=False)

    @override
    def on_train_start(self) -> None:
        set_schedule_free_mode(self, train=True)

    @override
    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        set_schedule_free_mode(self, train=False)

    @override
    def on_validation_model_train(self) -> None:
        super().on_validation_model_train()
        set_schedule_free_mode(self, train=True)

    @override
    def on_train_end(self) -> None:
        # Hand back the averaged weights: they are the model schedule-free methods promise.
        set_schedule_free_mode(self, train=False)
