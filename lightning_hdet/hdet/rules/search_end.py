"""When the search's evidence is in: a test a vote inside the search runs before ``Search.steps`` (pure).

The search ends on a grid of ratio ``refine_spread`` around its winner's LR (:func:`~lightning_hdet.hdet.multipliers
.centred_grid`). That grid keeps the LRs near the winner's, so the search has nothing left to decide once every group
*outside* it has lost to the winner by more than the noise: ``z`` standard errors of the difference of two interval
means, each group's from its loss curve's scatter about a straight line (:func:`detrended_error`: early in a run the
loss falls within an interval, and that fall is the same for every group, not noise in its mean).
Groups inside the grid's span need not be told apart from the winner: the grid goes on trying their LRs.

The test looks at each vote of the search, so it is a sequential test with up to a few looks: pick ``z`` above the
one-look 2.0 (a Pocock boundary for three looks at 5 % is 2.29; 2.5 was measured, docs/research).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_hdet.hdet.rules.signals import bin_means
from lightning_hdet.hdet.rules.votes import winner_of

def detrended_error(row: Sequence[float]) -> float:
    """Standard error of the interval's mean loss from a gathered loss-curve row (``[sums..., counts...]`` of equal
    bins, :class:`~lightning_hdet.hdet.rules.signals.LossCurve`): the bin means' scatter about their least-squares
    line over the square root of their number. 0.0 with fewer than three counted bins (nothing left to scatter)."""
    points = bin_means(row)
    if len(points) < 3 or not all(math.isfinite(m) for _, m in points):
        return 0.0
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    residuals = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in points)
    return math.sqrt(residuals / (n - 2) / n)


def refine_span(num_groups: int, ratio: float) -> float:
    """The factor by which the grid the search ends on reaches either side of its centre: ``ratio ** ((G - 1) / 2)``
    (four groups at 1.5: 0.54x to 1.84x the winner's LR)."""
    return float(ratio) ** ((num_groups - 1) / 2)


def evidence_is_in(losses: Sequence[float], errors: Sequence[float], healthy: Sequence[bool],
                   lrs: Sequence[float], winner: int, span: float, z: float) -> bool:
    """Whether every healthy group whose LR lies outside ``[lr_w / span, lr_w * span]`` (the refine grid around the
    winner ``w``) lost to ``w`` by more than ``z`` standard errors of the difference. False when there is no such
    group (nothing was ruled out: every LR tried is still in the grid), when any error is unknown (0 or not finite:
    an interval too short for its curve to say), or when the winner is not healthy."""
    if not 0 <= winner < len(losses) or not healthy[winner]:
        return False
    low, high = lrs[winner] / span, lrs[winner] * span
    outside = [g for g in range(len(losses)) if healthy[g] and g != winner
               and not low * (1 - 1e-9) <= lrs[g] <= high * (1 + 1e-9)]
    if not outside:
        return False
    for g in (winner, *outside):
        if not (math.isfinite(errors[g]) and errors[g] > 0 and math.isfinite(losses[g])):
            return False
    return all(losses[g] - losses[winner] > z * math.hypot(errors[g], errors[winner]) for g in outside)


def curves_show_evidence(rows: Sequence[Sequence[float]], losses: Sequence[float], healthy: Sequence[bool],
                         lrs: Sequence[float], ratio: float, z: float) -> bool:
    """:func:`evidence_is_in` for a vote: each group's error from its gathered loss-curve row, the winner the
    healthy group of the lowest loss (:func:`~.votes.winner_of`), the span of a grid of ``ratio`` over the groups."""
    winner = winner_of(losses, healthy)
    errors = [detrended_error(row) for row in rows]
    return evidence_is_in(losses, errors, healthy, lrs, winner, refine_span(len(losses), ratio), z)
