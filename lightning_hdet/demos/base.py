"""What the demo models share: loss logging per step and per validation, and schedule-free weight swaps."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from typing_extensions import override

from lightning_hdet._checks import is_int, require
from lightning_hdet.demos.optim import set_schedule_free_mode


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


class DemoModule(LightningModule):
    """Base of the demo models: subclasses define ``_loss(batch)``; this logs ``train_loss`` every step and
    ``val_loss`` per validation (unsynchronised: under HDET each group keeps its own value, the vote's signal),
    and lets a schedule-free optimizer train on its interpolated weights and validate on its average
    (``optimizer.train()`` / ``optimizer.eval()``; a no-op for every other optimizer)."""

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        raise NotImplementedError

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def heldout_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """The batch's mean loss, without logging: what ``HDETCallback(signal="heldout")`` scores."""
        return self._loss(batch)

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
