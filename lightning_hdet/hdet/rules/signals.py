"""An interval's loss curve, kept on the device, and what the vote reads from it (pure math, plus a device-side
accumulator).

:class:`LossCurve` keeps the per-step losses in ``bins`` equal bins on the training device: one indexed add per step
(no device->host sync), read once at the vote for the interval's mean loss and its standard error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_hdet._checks import check_int

CURVE_BINS = 8  # bins of an interval's loss curve kept on the device (``Signal.bins``)


class LossCurve:
    """Per-step losses of one interval, summed into ``bins`` equal bins of the interval's steps on ``device``.

    Fixed size, so the per-step cost is constant whatever the interval's length (at most ``interval`` bins).

    Step ``position`` (0-based, counted from the interval's start) lands in bin ``position * bins // interval``;
    steps past the interval (a longer last interval) land in the last bin. Sums live on the device; the counts
    are host integers (the positions are known without looking at the loss).
    """

    def __init__(self, interval: int, bins: int = CURVE_BINS, device: Optional[torch.device] = None) -> None:
        check_int("interval", interval, minimum=1)
        check_int("bins", bins, minimum=2)
        self.interval = interval
        self.bins = min(bins, interval)  # every bin then holds at least one step
        self.sums = torch.zeros(self.bins, dtype=torch.float64, device=device)
        self.counts = [0] * self.bins

    def bin_of(self, position: int) -> int:
        return min(max(position, 0) * self.bins // self.interval, self.bins - 1)

    def add(self, position: int, loss: Tensor) -> None:
        """Add one step's loss (a device tensor; its sum if it has several elements) at ``position``."""
        b = self.bin_of(position)
        value = loss.detach().to(self.sums.device)
        # One in-place add on the bin's view (float64 accumulates): a scalar loss costs one launch per step.
        self.sums.select(0, b).add_(value if value.dim() == 0 else value.sum())
        self.counts[b] += 1

    def row(self) -> Tensor:
        """``[sums..., counts...]`` on the device: one row to gather (summed over the ranks of a group)."""
        counts = torch.tensor(self.counts, dtype=torch.float64).to(self.sums.device, non_blocking=True)
        return torch.cat([self.sums, counts])

    def load_row(self, row: Tensor) -> None:
        """Restore from :meth:`row` (e.g. a checkpoint written mid-interval)."""
        row = row.to(torch.float64).cpu()
        self.sums.copy_(row[: self.bins])
        self.counts = [int(round(float(c))) for c in row[self.bins :]]

    def reset(self) -> None:
        self.sums.zero_()
        self.counts = [0] * self.bins


def bin_means(row: Sequence[float]) -> list[tuple[int, float]]:
    """``(bin, mean loss)`` of every counted bin of a gathered :meth:`LossCurve.row`."""
    bins = len(row) // 2
    return [(b, row[b] / row[bins + b]) for b in range(bins) if row[bins + b] > 0]


def curve_error(row: Sequence[float]) -> float:
    """Standard error of the interval's mean loss from a gathered :meth:`LossCurve.row`: the spread of its bin
    means over the square root of their number (0.0 with fewer than two bins; a trend inflates it, which only
    makes the safety net's noise margins wider)."""
    means = [mean for _, mean in bin_means(row)]
    if len(means) < 2 or not all(math.isfinite(m) for m in means):
        return 0.0
    centre = sum(means) / len(means)
    return math.sqrt(sum((m - centre) ** 2 for m in means) / (len(means) - 1) / len(means))


def mean_loss(row: Sequence[float]) -> float:
    """The interval's mean loss per step from a gathered :meth:`LossCurve.row` (``nan`` if no step was counted)."""
    bins = len(row) // 2
    count = sum(row[bins:])
    return sum(row[:bins]) / count if count > 0 else math.nan
