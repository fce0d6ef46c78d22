"""The strategy's read-outs of its exchange, and the global model rank 0 shows validation and checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Optional

from typing_extensions import override

from lightning_hdet.asynchronous.exchange.exchange import Exchange
from lightning_hdet.asynchronous.exchange.worker_shards import global_model_shards
from lightning_hdet.asynchronous.lightning.shard_hooks import sharded_module_state
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.result import AsyncResult, make_async_result
from lightning_hdet.records import History


def outer_result(outer: OuterState, ended: Optional[Mapping[int, str]] = None,
                 local_worker: Optional[int] = None) -> AsyncResult:
    """What the run behind ``outer`` did so far (one consistent read)."""
    with outer.lock:
        workers = {w: dict(vars(s)) for w, s in outer.workers.items()}
        return make_async_result(outer.step_policy.mode, outer.budget, outer.steps_done, outer.outer_updates, workers,
                                 ended, local_worker)


class ExchangeReadouts:
    """The async strategy's read-outs of its exchange (kept after ``fit``), and its hooks that show validation and
    checkpoints the global model (rank 0, while training). Mixed into the strategy, which sets these:"""

    _exchange: Exchange | None
    training_apart: bool
    report: History  # rank 0: the outer metrics logged, for the figures
    _logged_version = -1
    _handed_back: AsyncResult | None = None  # the launching process of a fork/spawn fit: rank 0's result
    _outer: OuterState | None  # rank 0's outer state while it has an exchange (WorkerCheckpoints')
    take_snapshot: Callable[[], Optional[dict[str, Any]]]
    start_validation: Callable[[], Optional[dict[str, Any]]]
    end_validation: Callable[[], None]

    def _global_model(self, snapshot: dict[str, Any] | None = None) -> AbstractContextManager[None]:
        """On rank 0 during training: swap in the global model (or ``snapshot``'s) for the block."""
        if self.training_apart and self._outer is not None and self._exchange is not None:
            return self._exchange.global_model(snapshot)
        return nullcontext()

    @property
    def rounds(self) -> list[tuple[int, int]]:
        """This worker's own history: one entry per exchange, ``(local_steps_assigned, outer_updates_seen)``."""
        return self._exchange.worker.rounds if self._exchange is not None else []

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps this worker took in the current (or last) ``fit``."""
        return self._exchange.worker.inner_steps if self._exchange is not None else 0

    @property
    def outer_updates(self) -> int:
        """How many times the outer optimizer has stepped (rank 0; 0 elsewhere)."""
        return self._outer.outer_updates if self._outer is not None else 0

    @property
    def budget_done(self) -> float | None:
        """The share of the job's inner-step budget done (rank 0 with a budget; else ``None``)."""
        outer = self._outer
        return outer.steps_done / outer.budget if outer is not None and outer.budget else None

    def worker_stats(self) -> dict[int, dict[str, float]]:
        """Per-worker progress as the outer optimizer saw it (rank 0; empty elsewhere)."""
        return self._outer.worker_stats() if self._outer is not None else {}

    @property
    def result(self) -> AsyncResult | None:
        """Rank 0, during and after ``fit``, and the launching process of a fork/spawn fit after it: what every
        worker did (summary printed at the end); else ``None``."""
        return self._handed_back if self._outer is None else outer_result(self._outer, local_worker=0)  # rank 0's own

    def hand_back(self) -> AsyncResult | None:
        """Rank 0 after a fork/spawn fit: the result the launching process's strategy takes back."""
        return self.result

    def take_back(self, value: AsyncResult) -> None:
        self._handed_back = value

    def _log_outer_metrics(self) -> None:
        """Rank 0: the outer metrics to the loggers (and :attr:`report`), when they changed since last logged."""
        if self._outer is None or self._outer.metrics_version == self._logged_version:
            return
        self._logged_version = self._outer.metrics_version
        trainer = self.lightning_module.trainer
        metrics = self._outer.metrics()
        self.report.add(trainer.global_step, metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._validation_view = ExitStack()  # closed in on_validation_end
        snapshot = self.start_validation() if self.training_apart else None  # what a checkpoint at its end saves
        if self.shard_group is not None and self.training_apart:
            self._validation_view.enter_context(global_model_shards(
                self.lightning_module, self.root_device, self._outer, self.exchange_group, 0, snapshot))
        else:
            self._validation_view.enter_context(self._global_model(snapshot))

    @override
    def on_validation_end(self) -> None:
        view = getattr(self, "_validation_view", None)
        if view is not None:
            view.close()
        self.end_validation()
        super().on_validation_end()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The global model's state. On rank 0 while training, one outer-state snapshot is both this state dict's
        source and the checkpoint's outer state, so the two always hold the same global model."""
        snapshot = self.take_snapshot()
        if self.shard_group is not None:
            return sharded_module_state(self.lightning_module, snapshot, self._outer, self.is_global_zero)
        with self._global_model(snapshot):
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}
