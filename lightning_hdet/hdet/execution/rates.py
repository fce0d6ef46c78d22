"""Every group's learning rates as the votes read and write them: the multiplier table times the schedule.

:class:`LearningRates` is the table's face toward :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback`
(``strategy.hdet.table``); the table itself (:class:`~lightning_hdet.hdet.multipliers.MultiplierTable`) stays
where the strategy applies its rows around every optimizer step. The same class serves the in-memory fake, over its
own table and a fixed schedule.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from lightning_hdet.hdet.multipliers import MultiplierTable


class RateSource(Protocol):
    """Where the rates come from: the table, how many groups it has rows for, what the schedule says."""

    @property
    def multiplier_table(self) -> MultiplierTable: ...

    @property
    def num_groups(self) -> int: ...

    def schedule_lrs(self) -> Tensor:
        """The learning rate the optimizers and schedulers say, per flattened param group (no multiplier)."""


class LearningRates:
    """Read and write every group's multipliers, and the real learning rates they give (call on every rank with
    the same values)."""

    def __init__(self, source: RateSource) -> None:
        self.source = source

    @property
    def multipliers(self) -> Tensor:
        """A copy of the table, ``(num_groups, num_param_groups)``, float64 on the host."""
        return self.source.multiplier_table.get(len(self.source.schedule_lrs()))

    def set(self, multipliers: Any) -> None:
        """Replace the table (``G`` values, all param groups alike, or a ``G x P`` table): the only writer at run
        time; applied around every later optimizer step."""
        self.source.multiplier_table.set(multipliers, self.source.num_groups, len(self.source.schedule_lrs()))

    def schedule_lrs(self) -> Tensor:
        """What the optimizers and schedulers say, per flattened param group (no multiplier)."""
        return self.source.schedule_lrs()

    def current_lrs(self) -> Tensor:
        """Real learning rates ``(num_groups, num_param_groups)``: schedule LR x multiplier."""
        return self.multipliers * self.schedule_lrs()
