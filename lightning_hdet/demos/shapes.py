"""A second workload of a different kind: a small conv net classifying procedurally generated images.

Nothing is downloaded: :func:`make_shapes` draws ``size × size`` grey images of :data:`CLASSES` (shapes and
striped textures at random positions, sizes, contrasts and stripe phases) under Gaussian pixel noise, from a
seeded ``torch.Generator``, so every process and every machine builds identical tensors. The noise and the
small sizes keep the task from being solved in a few steps, so the learning rate matters over a few hundred.
A constant predictor scores ``ln(len(CLASSES))`` (chance level), the loss a collapsed run sits at.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet._checks import check_choice
from lightning_hdet.demos.base import DemoModule, check_shard_train, check_shuffle_seed, training_loader
from lightning_hdet.demos.optim import OPTIMIZERS, SCHEDULES

CLASSES = ("disc", "square", "plus", "ring", "horizontal stripes", "vertical stripes")


def _masks(kind: Tensor, dx: Tensor, dy: Tensor, radius: Tensor, phase: Tensor) -> Tensor:
    """Binary masks ``(n, size, size)`` of each sample's class, from offsets ``dx, dy`` to its centre."""
    inside = torch.maximum(dx.abs(), dy.abs()) <= radius
    dist = torch.sqrt(dx**2 + dy**2)
    arm = radius / 3
    period = 3.0
    shapes = torch.stack([
        dist <= radius,
        inside,
        ((dx.abs() <= arm) & (dy.abs() <= radius)) | ((dy.abs() <= arm) & (dx.abs() <= radius)),
        (dist - radius).abs() <= 0.8,
        inside & (torch.sin(2 * math.pi * dy / period + phase) > 0),
        inside & (torch.sin(2 * math.pi * dx / period + phase) > 0),
    ])  # (classes, n, size, size)
    return shapes[kind, torch.arange(kind.numel())].float()


def make_shapes(num: int, size: int = 16, noise: float = 0.6, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``num`` images ``(num, 1, size, size)`` (float32) and labels ``(num,)`` (int64), determined by ``seed``.

    Classes are balanced in expectation (drawn uniformly). Each image is ``contrast × mask + noise × N(0, 1)``
    with the contrast in [0.5, 1.5] and the shape's radius between ``size/8`` and ``size/3``.
    """
    if not isinstance(num, int) or num < 1:
        raise ValueError(f"num must be a positive int, got {num!r}")
    if not isinstance(size, int) or size < 8:
        raise ValueError(f"size must be an int >= 8, got {size!r}")
    if not (isinstance(noise, (int, float)) and noise >= 0):
        raise ValueError(f"noise must be a number >= 0, got {noise!r}")
    gen = torch.Generator().manual_seed(seed)

    def uniform(lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(num, 1, 1, generator=gen)

    labels = torch.randint(len(CLASSES), (num,), generator=gen)
    radius = uniform(size / 8, size / 3)
    cx, cy = (radius + uniform(0, 1) * (size - 1 - 2 * radius) for _ in range(2))  # the shape stays inside
    phase = uniform(0, 2 * math.pi)
    contrast = uniform(0.5, 1.5)
    coords = torch.arange(size, dtype=torch.float32)
    dx, dy = coords.view(1, 1, size) - cx, coords.view(1, size, 1) - cy
    images = contrast * _masks(labels, dx, dy, radius, phase) + noise * torch.randn(num, size, size, generator=gen)
    return images.unsqueeze(1), labels


class ShapesDataModule(LightningDataModule):
    """Train and validation sets of :func:`make_shapes`, built from two different seeds derived from ``seed``.

    Like :class:`~lightning_hdet.demos.CharCorpusDataModule`, every rank builds the same data; under DDP
    Lightning's ``DistributedSampler`` shards the shuffled training set. Validation is not shuffled.

    Args:
        batch_size: images per batch (per process).
        num_train: training images.
        num_val: validation images.
        size: image side in pixels.
        noise: standard deviation of the pixel noise.
        seed: data seed (the training shuffle follows the global seed, as for any ``DataLoader``).
        shuffle_seed: a fixed training order instead (see :func:`~lightning_hdet.demos.base.shuffle_generator`).
        shard_train: each rank reads its own shard of the training set and the whole validation set (see
            :func:`~lightning_hdet.demos.base.training_loader`; use with ``use_distributed_sampler=False``).
    """

    num_classes = len(CLASSES)

    def __init__(
        self, batch_size: int = 32, num_train: int = 8192, num_val: int = 1024, size: int = 16, noise: float = 0.6,
        seed: int = 0, shuffle_seed: int | None = None, shard_train: bool = False,
    ) -> None:
        super().__init__()
        check_shuffle_seed(shuffle_seed)
        check_shard_train(shard_train)
        self.shuffle_seed = shuffle_seed
        self.shard_train = shard_train
        for name, value in (("batch_size", batch_size), ("num_train", num_train), ("num_val", num_val)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.save_hyperparameters()
        self.batch_size = batch_size

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        self.train_set = TensorDataset(*make_shapes(hp.num_train, hp.size, hp.noise, seed=2 * hp.seed))
        self.val_set = TensorDataset(*make_shapes(hp.num_val, hp.size, hp.noise, seed=2 * hp.seed + 1))

    def train_dataloader(self) -> DataLoader:
        return training_loader(self.train_set, self.batch_size, self.shuffle_seed, self.shard_train, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)


class ShapesCNN(DemoModule):
    """A small conv net (three 3×3 conv layers with ReLU, two max-pools, global average pooling, a linear
    head; no batch norm, so a DDP run equals one process on the whole batch); logs ``train_loss`` every step
    and ``val_loss`` per validation (unsynchronised: under HDET each group keeps its own).

    Args:
        num_classes: outputs of the head.
        width: channels of the first conv layer (the next two have twice as many).
        lr: learning rate (for Prodigy, the multiplier of its own estimate; 1.0 recommended).
        optimizer: one of ``"adamw"``, ``"sgd"`` (momentum 0.9), ``"prodigy"``, ``"schedulefree"`` (AdamW).
        weight_decay: decoupled for the Adam family, L2 for SGD.
        scheduler: ``"constant"`` (a bare optimizer) or ``"cosine"`` (``CosineAnnealingLR`` to zero over the
            fit's ``estimated_stepping_batches``, stepped every step).
    """

    def __init__(
        self, num_classes: int = len(CLASSES), width: int = 16, lr: float = 3e-3, optimizer: str = "adamw",
        weight_decay: float = 0.0, scheduler: str = "constant",
    ) -> None:
        super().__init__()
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("scheduler", scheduler, SCHEDULES)
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(batch, classes)`` for images ``(batch, 1, H, W)``."""
        return self.head(self.features(images))

