"""Shared pieces for the multi-process tests: tiny models and a recorder that writes per-rank results."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, Dataset

# How most multi-process tests start their ranks: Lightning's own multiprocessing launcher with "fork" (what
# `strategy="ddp_fork"` uses). A forked rank shares the test process's imported torch and Lightning; a spawned one
# imports them again, about 5 CPU-seconds per rank, which made spawning most of the suite's time on 2 cores.
# `spawn` (pickling the strategy and callbacks across) is tested where it matters: tests/test_spawn.py,
# tests/test_async_spawn.py and the W&B test; the default subprocess launcher by the tests that run scripts.
START = "fork"


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])


class SGDBoring(BoringModel):
    """BoringModel with plain SGD (no momentum) and a configurable schedule / param groups."""

    def __init__(self, lr: float = 0.1, scheduler: Optional[str] = None, two_groups: bool = False,
                 momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.scheduler, self.two_groups, self.momentum = lr, scheduler, two_groups, momentum

    def configure_optimizers(self) -> Any:
        if self.two_groups:
            params = [{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": self.lr * 0.1}]
        else:
            params = self.parameters()
        opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler(self.scheduler, opt), "interval": "step"}}


def make_scheduler(name: str, opt: torch.optim.Optimizer) -> Any:
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if name == "onecycle":
        max_lr = [pg["lr"] for pg in opt.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=64)
    raise ValueError(name)


class Regression(Dataset):
    """A fixed linear-regression task: y = X w* + noise."""

    def __init__(self, n: int = 256, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.01 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LinearModel(LightningModule):
    """Least squares with SGD: a group whose LR is far above 2/curvature diverges to inf/NaN."""

    def __init__(self, lr: float = 0.05, optimizer: str = "sgd", batch_size: int = 16, n_train: int = 256) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer in ("adam", "fused-adam"):  # fused: skips non-finite steps on the device
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, fused=self.hparams.optimizer == "fused-adam")
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=self.hparams.n_train), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=64, seed=1), batch_size=32)


class Recorder(Callback):
    """Records, per rank, what the tests assert on, and writes it to ``out/rank{r}.pt`` at the end of fit."""

    def __init__(self, out: str | os.PathLike, when: str = "end") -> None:
        self.out = Path(out)
        self.when = when
        self.effective_lrs: list[list[float]] = []
        self.schedule_lrs: list[list[float]] = []
        self.grads: list[torch.Tensor] = []
        self.params_by_step: dict[int, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.effective_lrs.append([float(pg["lr"]) for pg in optimizer.param_groups])
        self.grads.append(torch.cat([p.grad.detach().reshape(-1).double().cpu() for p in pl_module.parameters()
                                     if p.grad is not None]))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.schedule_lrs.append([float(pg["lr"]) for opt in trainer.optimizers for pg in opt.param_groups])
        self.params_by_step[trainer.global_step] = flat_params(pl_module)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        info = {
            "rank": trainer.global_rank,
            "effective_lrs": self.effective_lrs,
            "schedule_lrs": self.schedule_lrs,
            "grads": self.grads,
            "params_by_step": self.params_by_step,
            "final_params": flat_params(pl_module),
            "losses": self.losses,
            "global_step": trainer.global_step,
            "sched_last_lr": [cfg.scheduler.get_last_lr() for cfg in trainer.lr_scheduler_configs],
        }
        for name in ("group_index", "num_groups", "group_ranks", "lr_multiplier", "skipped_steps"):
            if hasattr(strategy, name):
                info[name] = getattr(strategy, name)
        if hasattr(strategy, "lr_multipliers"):
            info["lr_multipliers"] = strategy.lr_multipliers
        hdet = [cb for cb in trainer.callbacks if type(cb).__name__ == "HDETCallback"]
        if hdet:
            info["history"] = hdet[0].history
            info["rescues"] = hdet[0].rescues
            info["restarted_at"] = hdet[0].controller.restarted_at
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def load_ranks(out: str | os.PathLike, n: int) -> list[dict[str, Any]]:
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(n)]


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=4, max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def quiet_trainer(**kwargs: Any) -> Trainer:
    """A CPU trainer without logger, checkpoints, progress bar, summary or sanity validation."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    return Trainer(**{**defaults, **kwargs})


class TrainLosses(Callback):
    """Records every training step's loss (``outputs["loss"]``) as a float."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


__all__ = ["BoringModel", "RandomDataset"]


#: The options of ``WorkerShape`` (``AsyncLocalSGDStrategy(worker=...)``).
SHAPE_OPTIONS = ("ranks_per_worker", "inside_worker", "auto_wrap_policy", "overlap_steps", "stagger")


def async_strategy(**kwargs: Any) -> Any:
    """``AsyncLocalSGDStrategy`` from one flat table of arguments (the refused combinations' tables): ``WorkerShape``'s
    options among them go into ``worker=``."""
    from lightning_hdet import AsyncLocalSGDStrategy, WorkerShape

    shape = {k: kwargs.pop(k) for k in SHAPE_OPTIONS if k in kwargs}
    return AsyncLocalSGDStrategy(**kwargs, **({"worker": WorkerShape(**shape)} if shape else {}))


