"""Vote signals from each group's loss curve within one interval (pure math, plus a device-side accumulator).

The interval's *mean* loss favours the lowest learning rate right after a merge (short-horizon bias, Wu et al.
2018): the high-LR group pays its noise now and collects its progress later. Two signals look at the *shape* of the
curve instead:

* ``improvement``: the least-squares slope of the loss over the interval (FIRE-PBT, AdaLRS: rank by the rate of
  descent, not the level). A more negative slope is better.
* ``forecast``: fit ``L(t) = a + b * exp(-c t)`` to the curve and read it at a later step (AutoLRS), so a curve that
  is still falling steeply is credited with where it is heading.

Both need the per-step losses, which :class:`LossCurve` keeps in ``bins`` equal bins on the training device: one
indexed add per step (no device->host sync), read once at the vote.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from lightning_hdet._checks import check_choice, check_int, check_number, require

SIGNALS = ("mean", "improvement", "forecast", "heldout")  # "heldout": see hdet/lightning/heldout.py
CURVE_BINS = 8  # bins of an interval's loss curve kept on the device (a curve signal's ``bins`` by default)
# Decay rates tried by the forecast, as multiples of 1 / interval: slower ones make the fit's asymptote an
# ill-conditioned extrapolation far below the data; faster ones are indistinguishable from a step.
_RATES = [0.5 * 1.25**k for k in range(18)]

Point = tuple[float, float]  # (step within the interval, mean loss of the steps in that bin)


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


def bin_centers(interval: int, bins: int) -> list[float]:
    """The mean position of the steps that land in each bin (``nan`` for a bin no step reaches)."""
    members: list[list[int]] = [[] for _ in range(bins)]
    for position in range(interval):
        members[min(position * bins // interval, bins - 1)].append(position)
    return [sum(m) / len(m) if m else math.nan for m in members]


def curve_points(row: Sequence[float], interval: int) -> list[Point]:
    """Turn a gathered :meth:`LossCurve.row` into ``(step, mean loss)`` points, skipping empty bins."""
    bins = len(row) // 2
    centers = bin_centers(interval, bins)
    return [(centers[b], row[b] / row[bins + b]) for b in range(bins) if row[bins + b] > 0 and math.isfinite(centers[b])]


def slope(points: Sequence[Point]) -> float:
    """Least-squares slope of the loss per step (``nan`` with fewer than two points or a non-finite loss)."""
    if len(points) < 2 or not all(math.isfinite(y) for _, y in points):
        return math.nan
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def fit_exponential(points: Sequence[Point], interval: int) -> Optional[tuple[float, float, float]]:
    """Least-squares fit of ``L(t) = a + b * exp(-c t)``: ``(a, b, c)``, or ``None`` with fewer than three points.

    For each decay rate ``c`` on a fixed grid the best ``(a, b)`` is a 2x2 linear least-squares problem; the rate
    with the smallest squared error wins (a grid keeps the fit deterministic and free of iterative solvers).
    """
    if len(points) < 3 or not all(math.isfinite(y) for _, y in points):
        return None
    best: Optional[tuple[float, float, float, float]] = None
    for rate in _RATES:
        c = rate / interval
        xs = [math.exp(-c * x) for x, _ in points]
        ys = [y for _, y in points]
        n, sx, sy = len(xs), sum(xs), sum(ys)
        sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
        det = n * sxx - sx * sx
        if det <= 1e-15:
            continue
        b = (n * sxy - sx * sy) / det
        a = (sy - b * sx) / n
        sse = sum((a + b * x - y) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0]:
            best = (sse, a, b, c)
    return None if best is None else best[1:]


def forecast(points: Sequence[Point], interval: int, horizon: float) -> float:
    """The loss the interval's curve points to at step ``horizon`` (counted from the interval's start).

    Falls back to the last point's loss when the curve has too few points to fit.
    """
    if not points:
        return math.nan
    fit = fit_exponential(points, interval)
    if fit is None:
        return points[-1][1]
    a, b, c = fit
    return a + b * math.exp(-c * horizon)


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


def score(row: Sequence[float], signal: str, interval: int, horizon: Optional[float] = None) -> float:
    """The number a vote compares for one group, from its gathered curve row (lower is better).

    ``mean``: the interval's mean loss (today's signal); ``improvement``: the slope of the loss per step;
    ``forecast``: the fitted curve at step ``horizon`` of the interval (default: four intervals on).
    """
    check_choice("signal", signal, SIGNALS)
    require("signal", signal, signal != "heldout", "a signal of the training curve here",
            "signal='heldout' scores averaged parameters on held-out batches (hdet/lightning/heldout.py), "
            "not the curve.")
    if signal == "mean":
        return mean_loss(row)
    points = curve_points(row, interval)
    if signal == "improvement":
        return slope(points)
    check_number("horizon", horizon, low=0, optional=True)
    return forecast(points, interval, 4.0 * interval if horizon is None else horizon)


def scores(rows: Tensor, signal: str, interval: int, horizon: Optional[float] = None) -> list[float]:
    """:func:`score` of every group from the gathered ``(G, 2 * bins)`` table of :meth:`LossCurve.row`."""
    return [score(row, signal, interval, horizon) for row in rows.tolist()]
