"""What a finished (or running) exchange tells about itself, read from the strategy that drove it."""

from __future__ import annotations

from lightning_hdet.asynchronous.exchange import Exchange
from lightning_hdet.asynchronous.outer import OuterState


class ExchangeReadouts:
    """The async strategy's read-outs of its exchange (kept after ``fit``; empty before the first)."""

    _exchange: Exchange | None

    @property
    def _outer(self) -> OuterState | None:
        """Rank 0, during and after ``fit``: the outer state (``None`` elsewhere)."""
        return self._exchange.outer if self._exchange is not None else None

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

    def worker_stats(self) -> dict[int, dict[str, float]]:
        """Per-worker progress as the outer optimizer saw it (rank 0 only; empty elsewhere): inner ``steps``,
        completed ``rounds``, ``local_steps`` of the next round, ``steps_per_s``, ``staleness``."""
        return self._outer.worker_stats() if self._outer is not None else {}
