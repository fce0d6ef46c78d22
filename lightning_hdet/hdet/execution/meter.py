"""What one rank measures during a vote interval, kept on the training device (torch only: no Lightning).

:class:`IntervalMeter` holds this rank's loss curve (:class:`~lightning_hdet.hdet.rules.signals.LossCurve`), the loss of
the run's very first step (the safety net's starting level, pooled over every rank with its standard error) and
the monitored metric, and packs them with the
skipped-step count into one row, so a vote needs a single small all-reduce (the strategy's ``gather_group_values``).
Per step it does one indexed add on the device: no device->host sync.

Row layout: ``[curve sums (K) | curve counts (K) | first-step loss sum, sum of squares, count | monitored value,
count | skipped]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_hdet.hdet.rules.signals import LossCurve, mean_loss

_TAIL = 6  # first-step loss sum, sum of squares, count; monitored value, count; skipped steps


@dataclass
class Reading:
    """One vote's numbers for every group, identical on every rank."""

    losses: list[float]  # the interval's mean training loss (or the monitored metric); NaN if none was counted
    finite: list[bool]  # the group counted something and skipped no optimizer step
    curves: Tensor  # ``(num_groups, 2 * bins)``: every group's loss curve, per rank of the group
    first_losses: Optional[list[float]]  # the first step's loss (pooled over every rank), where this interval holds it
    counted: bool  # some group counted a training loss (or the monitored metric)
    first_errors: Optional[list[float]] = None  # its standard error over the ranks (0.0 with a single rank)


class IntervalMeter:
    """This rank's interval: loss curve and first-step loss on ``device`` (the monitored metric joins the row)."""

    def __init__(self, interval: int, bins: int, device: torch.device) -> None:
        self.curve = LossCurve(interval, bins, device)
        self.first = torch.zeros(3, dtype=torch.float64, device=device)
        self.start_step = 0  # the optimizer step the interval started at

    @property
    def width(self) -> int:
        return 2 * self.curve.bins + _TAIL

    def add(self, step: int, loss: Tensor, first: bool) -> None:
        """Count the loss of the step that just ended at ``step``; ``first``: it is the run's first step."""
        self.curve.add(step - 1 - self.start_step, loss)
        if first:
            value = loss.detach().to(self.first.device, torch.float64).sum()
            self.first[0] += value
            self.first[1] += value * value
            self.first[2] += 1

    def row(self, skipped: int, monitored: Optional[float] = None) -> Tensor:
        """This rank's numbers as one row (see the module docstring), on the device."""
        value = monitored
        tail = torch.tensor([0.0 if value is None else value, 0.0 if value is None else 1.0, float(skipped)],
                            dtype=torch.float64).to(self.first.device, non_blocking=True)
        return torch.cat([self.curve.row(), self.first, tail])

    def load_row(self, row: Tensor) -> None:
        """Restore a row written by :meth:`row` (resume in the middle of an interval)."""
        row = row.to(torch.float64).cpu()
        bins = self.curve.bins
        self.curve.load_row(row[: 2 * bins])
        self.first.copy_(row[2 * bins : 2 * bins + 3])

    def reset(self, step: int) -> None:
        """A new interval starts after optimizer step ``step``."""
        self.curve.reset()
        self.first.zero_()
        self.start_step = step

    def read(self, table: Tensor, monitor: bool) -> Reading:
        """Parse the gathered ``(num_groups, width)`` table (summed over the ranks of each group)."""
        bins = self.curve.bins
        curves = table[:, : 2 * bins]
        tail = table[:, 2 * bins :].tolist()
        if monitor:
            losses = [v / c if c > 0 else math.nan for *_, v, c, _ in tail]
            counts = [c for *_, c, _ in tail]
        else:
            losses = [mean_loss(row) for row in curves.tolist()]
            counts = curves[:, bins:].sum(dim=1).tolist()
        finite = [c > 0 and skipped == 0 for c, (*_, skipped) in zip(counts, tail)]
        first, error = _pooled_first([row[:3] for row in tail])
        num_groups = len(tail)
        return Reading(losses, finite, curves, None if first is None else [first] * num_groups,
                       any(c > 0 for c in counts), None if first is None else [error] * num_groups)


def _pooled_first(rows: list[list[float]]) -> tuple[Optional[float], float]:
    """The first step's loss over every rank (``[sum, sum of squares, count]`` per group) and its standard error.

    Every group starts from the same model, so each rank's first batch measures the same untrained loss: pooling
    them gives the safety net a starting level ``num_groups`` times less noisy than one group's.
    """
    total, squares, n = (sum(row[k] for row in rows) for k in range(3))
    if n <= 0:
        return None, 0.0
    mean = total / n
    variance = max(squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(variance / n)
