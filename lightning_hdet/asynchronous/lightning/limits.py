"""The trainer limits a worker's ``fit`` lifts while it trains apart, given back on every exit path."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl

from lightning_hdet._compat import set_loop_max_steps


class LoopLimits:
    """``max_steps`` and ``limit_val_batches`` as the user set them, lifted while a worker trains apart and
    restored however ``fit`` ends (left lifted, the next entry's ranks waited at a barrier)."""

    def __init__(self) -> None:
        self._saved: Optional[tuple[int, Any]] = None

    def lift(self, trainer: pl.Trainer) -> None:
        """Save the limits, then let the loop run until the strategy stops it."""
        self._saved = (trainer.fit_loop.max_steps, trainer.limit_val_batches)
        set_loop_max_steps(trainer, -1)

    def restore(self, module: pl.LightningModule) -> None:
        """Give ``module``'s trainer back what :meth:`lift` saved (once; nothing if nothing was lifted)."""
        if self._saved is not None:
            trainer = module.trainer
            set_loop_max_steps(trainer, self._saved[0])
            trainer.limit_val_batches = self._saved[1]
            self._saved = None
