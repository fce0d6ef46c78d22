"""What the async strategy shows while it trains (installed by the strategy when the user passed none)."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_hdet._compat import show_in_progress_bar
from lightning_hdet.asynchronous.lightning.readouts import ExchangeReadouts
from lightning_hdet.records import log_report_figures
from lightning_hdet.records.wandb import finish_worker_run, record_config


def _show_progress(trainer: pl.Trainer) -> None:
    """Rank 0's progress bar: outer updates, the slowest worker and the job's budget done."""
    strategy = _async_strategy(trainer)
    stats = strategy.worker_stats() if strategy is not None else {}
    if strategy is None or not stats:
        return
    shown: dict[str, Any] = {"async/outer_updates": strategy.outer_updates,
                             "async/slowest": min(stats, key=lambda w: stats[w]["steps_per_s"] or math.inf)}
    done = strategy.budget_done  # a counter read, not the whole result (this runs on every batch)
    if done is not None:
        shown["async/budget_done"] = done
    show_in_progress_bar(trainer, shown)


def _async_strategy(trainer: pl.Trainer) -> Any:
    """The trainer's async strategy, or ``None`` (by its read-outs: the strategy imports this module)."""
    return trainer.strategy if isinstance(trainer.strategy, ExchangeReadouts) else None


class AsyncLogging(Callback):
    """What the async strategy shows: rank 0's progress bar, the run config, the summary and figures at the end.
    Installed first: its ``on_train_end`` leaves the exchange, so the other callbacks see the final global model."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = _async_strategy(trainer)
        if stage == "fit" and strategy is not None:
            record_config(trainer, "async", strategy.config)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        _show_progress(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _async_strategy(trainer)
        if strategy is None:
            return
        strategy.leave_exchange()
        _show_progress(trainer)
        result = strategy.result
        if result is not None and result.budget is not None and result.steps_done >= result.budget:
            rank_zero_info(f"`Trainer.fit` stopped: the budget of `max_steps={result.budget // len(result.workers)}`"
                           f" ({result.budget} inner steps over {len(result.workers)} workers) is spent;"
                           f" `global_step` {trainer.global_step} counts rank 0's own steps.")

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
