"""What the async strategy shows while it trains (installed by the strategy when the user passed none)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_hdet.records import log_report_figures
from lightning_hdet.records.wandb import finish_worker_run, record_config

if TYPE_CHECKING:
    from lightning_hdet.asynchronous.strategy import AsyncLocalSGDStrategy


def _async_strategy(trainer: pl.Trainer) -> AsyncLocalSGDStrategy | None:
    from lightning_hdet.asynchronous.strategy import AsyncLocalSGDStrategy  # the strategy imports this module

    return trainer.strategy if isinstance(trainer.strategy, AsyncLocalSGDStrategy) else None


class AsyncLogging(Callback):
    """What the async strategy shows: the outer-update count and the slowest worker in the progress bar, its
    settings in the run config (``async/...``), and at the end of fit the run's summary (what every worker did)
    and the per-worker figures in W&B."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = _async_strategy(trainer)
        if stage == "fit" and strategy is not None:
            record_config(trainer, "async", strategy.config)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = _async_strategy(trainer)
        stats = strategy.worker_stats() if strategy is not None else {}
        if not stats:
            return
        slowest = min(stats, key=lambda w: stats[w]["steps_per_s"] or math.inf)
        pl_module.log("async/outer_updates", float(strategy.outer_updates), prog_bar=True, logger=False,
                      rank_zero_only=True)
        pl_module.log("async/slowest", float(slowest), prog_bar=True, logger=False, rank_zero_only=True)
        done = strategy.budget_done  # a counter read, not the whole result (this runs on every batch)
        if done is not None:
            pl_module.log("async/budget_done", done, prog_bar=True, logger=False, rank_zero_only=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _async_strategy(trainer)
        if trainer.is_global_zero and strategy is not None:
            if strategy.result is not None:
                rank_zero_info(strategy.result.summary())
            log_report_figures(trainer, strategy.report)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_worker_run(trainer)
