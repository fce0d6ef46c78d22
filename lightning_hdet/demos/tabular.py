"""A third workload of another kind: an MLP classifying generated tabular data.

Nothing is downloaded: :func:`make_tabular` draws rows of ``features`` standardised numeric columns from a seeded
``torch.Generator`` and labels each row with the class a fixed random *teacher* network (two tanh layers) scores
highest, then flips a share ``label_noise`` of the labels to a random class, so the task has a non-linear
boundary and a loss floor above zero (every process and machine builds identical tensors). Columns are
correlated (a random mixing of independent Gaussians), as in real tables. A constant predictor scores at most
``ln(classes)`` (the label distribution's entropy: the teacher's classes are not exactly balanced).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet._checks import check_choice, check_int, check_number
from lightning_hdet.demos.base import DemoModule, check_shard_train, check_shuffle_seed, training_loader
from lightning_hdet.demos.optim import OPTIMIZERS, SCHEDULES


def make_tabular(
    num: int, features: int = 16, classes: int = 8, label_noise: float = 0.1, seed: int = 0, task_seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``num`` rows ``(num, features)`` (float32) and labels ``(num,)`` (int64).

    ``task_seed`` fixes the task (column mixing and teacher), ``seed`` the rows drawn from it: a training and a
    validation set share ``task_seed`` and differ in ``seed``.
    """
    check_int("num", num, minimum=2, hint="Rows are standardised per column: at least two.")
    _check_task(features, classes, label_noise)
    task = torch.Generator().manual_seed(1_000_003 + task_seed)
    mixing = torch.randn(features, features, generator=task) / features**0.5 + torch.eye(features)
    hidden = 4 * features
    w1, b1 = torch.randn(features, hidden, generator=task) / features**0.5, torch.randn(hidden, generator=task)
    w2 = torch.randn(hidden, classes, generator=task) / hidden**0.5
    rows = torch.Generator().manual_seed(seed)
    x = torch.randn(num, features, generator=rows) @ mixing
    x = (x - x.mean(0)) / x.std(0)  # standardised columns, as a tabular pipeline would feed them
    labels = torch.tanh(torch.tanh(3 * x @ w1 / 2 + b1) @ w2 * 3).argmax(1)
    flip = torch.rand(num, generator=rows) < label_noise
    labels = torch.where(flip, torch.randint(classes, (num,), generator=rows), labels)
    return x.float(), labels


def prior_loss(labels: Tensor, classes: int) -> float:
    """The cross-entropy of predicting the labels' own distribution for every row: the best constant predictor,
    where a collapsed run sits."""
    p = torch.bincount(labels, minlength=classes).double() / labels.numel()
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def _check_task(features: int, classes: int, label_noise: float) -> None:
    check_int("features", features, minimum=2)
    check_int("classes", classes, minimum=2)
    check_number("label_noise", label_noise, 0.0, 1.0, high_open=True)


class TabularDataModule(LightningDataModule):
    """Train and validation sets of :func:`make_tabular` (one task, two row seeds derived from ``seed``).

    Args:
        batch_size: rows per batch (per process).
        num_train: training rows.
        num_val: validation rows.
        features: numeric columns.
        classes: label classes.
        label_noise: share of labels replaced by a random class.
        seed: data seed (the task and its rows).
        shuffle_seed: a fixed training order instead of the global seed's
            (see :func:`~lightning_hdet.demos.base.shuffle_generator`).
        shard_train: each rank reads its own shard of the training set (see
            :func:`~lightning_hdet.demos.base.training_loader`; use with ``use_distributed_sampler=False``).
    """

    def __init__(
        self, batch_size: int = 64, num_train: int = 16384, num_val: int = 2048, features: int = 16,
        classes: int = 8, label_noise: float = 0.1, seed: int = 0, shuffle_seed: int | None = None,
        shard_train: bool = False,
    ) -> None:
        super().__init__()
        check_shuffle_seed(shuffle_seed)
        check_shard_train(shard_train)
        for name, value in (("batch_size", batch_size), ("num_train", num_train), ("num_val", num_val)):
            check_int(name, value, minimum=1)
        _check_task(features, classes, label_noise)  # now, not at setup in every process
        self.save_hyperparameters()
        self.batch_size, self.shuffle_seed, self.shard_train = batch_size, shuffle_seed, shard_train
        self.num_features, self.num_classes = features, classes

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        task = (hp.features, hp.classes, hp.label_noise)
        self.train_set = TensorDataset(*make_tabular(hp.num_train, *task, seed=2 * hp.seed, task_seed=hp.seed))
        self.val_set = TensorDataset(*make_tabular(hp.num_val, *task, seed=2 * hp.seed + 1, task_seed=hp.seed))

    def train_dataloader(self) -> DataLoader:
        return training_loader(self.train_set, self.batch_size, self.shuffle_seed, self.shard_train, self.trainer)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False)


class TabularMLP(DemoModule):
    """An MLP (``depth`` hidden ReLU layers of ``width`` units, no normalisation, so a DDP run equals one process
    on the whole batch) with a linear head; logs ``train_loss``/``val_loss`` like the other demos.

    Args:
        features: input columns.
        num_classes: outputs of the head.
        width: units per hidden layer.
        depth: hidden layers.
        lr: learning rate (for Prodigy, the multiplier of its own estimate; 1.0 recommended).
        optimizer: one of ``"adamw"``, ``"sgd"`` (momentum 0.9), ``"prodigy"``, ``"schedulefree"`` (AdamW).
        weight_decay: decoupled for the Adam family, L2 for SGD.
        scheduler: ``"constant"`` (a bare optimizer) or ``"cosine"`` (``CosineAnnealingLR`` to zero over the
            fit's ``estimated_stepping_batches``, stepped every step).
    """

    def __init__(
        self, features: int = 16, num_classes: int = 8, width: int = 128, depth: int = 2, lr: float = 3e-3,
        optimizer: str = "adamw", weight_decay: float = 0.0, scheduler: str = "constant",
    ) -> None:
        super().__init__()
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("scheduler", scheduler, SCHEDULES)
        check_number("lr", lr, low=0.0, low_open=True)
        check_int("depth", depth, minimum=1)
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for k in range(depth):
            layers += [nn.Linear(features if k == 0 else width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, rows: Tensor) -> Tensor:
        """Logits ``(batch, classes)`` for rows ``(batch, features)``."""
        return self.head(self.body(rows))

