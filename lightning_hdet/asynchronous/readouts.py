"""What a finished (or running) exchange tells about itself, read from the strategy that drove it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

from lightning_hdet.asynchronous.exchange import Exchange
from lightning_hdet.asynchronous.outer import OuterState
from lightning_hdet.asynchronous.result import AsyncResult, make_async_result


def outer_result(outer: OuterState, ended: Optional[Mapping[int, str]] = None) -> AsyncResult:
    """What the run behind ``outer`` did so far (one consistent read)."""
    with outer.lock:
        workers = {w: dict(vars(s)) for w, s in outer.workers.items()}
        return make_async_result(outer.step_policy.mode, outer.budget, outer.steps_done, outer.outer_updates, workers,
                                 ended)


class ExchangeReadouts:
    """The async strategy's read-outs of its exchange (kept after ``fit``; empty before the first)."""

    _exchange: Exchange | None
    #: True while this rank trains apart from the others (set by the strategy).
    diverged: bool

    @property
    def _outer(self) -> OuterState | None:
        """Rank 0, during and after ``fit``: the outer state (``None`` elsewhere)."""
        return self._exchange.outer if self._exchange is not None else None

    @contextmanager
    def _global_model(self, snapshot: dict[str, Any] | None = None) -> Iterator[None]:
        """On rank 0 during training: temporarily swap in the current global parameters and buffers (or those of
        ``snapshot``, an outer state's ``state_dict``), for validation and checkpoints."""
        if not (self.diverged and self._outer is not None and self._exchange is not None):
            yield
            return
        with self._exchange.global_model(snapshot):
            yield

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
        """The share of the shared inner-step budget the workers have done (rank 0 with a budget; ``None``
        elsewhere): what ends the run, rather than this worker's own steps."""
        outer = self._outer
        return outer.steps_done / outer.budget if outer is not None and outer.budget else None

    def worker_stats(self) -> dict[int, dict[str, float]]:
        """Per-worker progress as the outer optimizer saw it (rank 0 only; empty elsewhere): inner ``steps``,
        completed ``rounds``, ``local_steps`` of the next round, ``steps_per_s``, ``staleness``."""
        return self._outer.worker_stats() if self._outer is not None else {}

    @property
    def result(self) -> AsyncResult | None:
        """Rank 0, during and after ``fit``: what every worker did (its :meth:`~.result.AsyncResult.summary` is
        printed at the end of ``fit``); ``None`` on the other ranks and before the first ``fit``."""
        return outer_result(self._outer) if self._outer is not None else None
