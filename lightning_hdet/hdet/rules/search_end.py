"""When the search's evidence is in: a test a vote inside the search runs before ``Search.steps`` (pure).

The search ends on a grid of ratio ``refine_spread`` around its winner's LR (:func:`~lightning_hdet.hdet.multipliers
.centred_grid`). That grid keeps the LRs near the winner's, so the search has nothing left to decide once every group
*outside* it has lost to the winner by more than the noise: ``z`` standard errors of the difference of two interval
means, each group's from its loss curve's scatter about a straight line (:func:`detrended_error`: early in a run the
loss falls within an interval, and that fall is the same for every group, not noise in its mean).
Groups inside the grid's span need not be told apart from the winner: the grid goes on trying their LRs.

The test looks at each vote of the search, so it is a sequential test with up to a few looks: pick ``z`` above the
one-look 2.0 (a Pocock boundary for three looks at 5 % is 2.29; 2.5 was measured, docs/research).

:class:`SearchPhase` is the controller's part that ends the search: at ``Search.steps``, or earlier on this test.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor

from lightning_hdet.hdet.multipliers import centred_grid
from lightning_hdet.hdet.rules.collapse import CollapseHistory, has_progressed
from lightning_hdet.hdet.rules.options import Search
from lightning_hdet.hdet.rules.signals import bin_means
from lightning_hdet.hdet.rules.votes import winner_of

if TYPE_CHECKING:
    from lightning_hdet.hdet.rules.controller import Interval

log = logging.getLogger(__name__)


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


class SearchPhase:
    """The search's end (:class:`~lightning_hdet.hdet.rules.options.Search`): from which step a vote may end it,
    whether a vote does, and the grid the groups train on after it.

    It owns ``steps``, ``searched_at`` and ``restarted_at`` (the controller checkpoints the last two under those
    keys). The controller keeps the vote rule and the collapse history: it passes the history in, and starts the rule
    afresh and restarts the history where :meth:`end` tells it to.

    Args:
        search: the search's options; ``None``: no search end (``steps`` is ``None``), though an interval told to
            refine still ends on ``Search()``'s grid.
    """

    def __init__(self, search: Optional[Search]) -> None:
        self.search = search
        # From which step a vote may end the search (None: never); the callback sizes it from the run's length.
        self.steps: Optional[int] = search.steps if search is not None else None
        self.searched_at: Optional[int] = None  # the step of the vote that ended the search
        self.restarted_at: Optional[int] = None  # that vote restarted every group from the initial model

    @property
    def refine_spread(self) -> float:
        """The ratio of the grid the search ends on (``Search``'s; its default for an interval told to refine)."""
        return (self.search or Search()).refine_spread

    def ends(self, step: int) -> bool:
        """Whether a vote at ``step`` ends the search (``steps``; it ends once)."""
        return self.steps is not None and step >= self.steps and self.searched_at is None

    def ends_here(self, interval: Interval, healthy: Sequence[bool], history: CollapseHistory, curves: bool) -> bool:
        """Whether this vote ends the search: told to (``interval.refine``) or, before ``steps``, with the evidence
        in (``curves``: the vote may be judged on its training-loss curves, as the progress rules are: after
        warm-up, not at the final merge, not with ``monitor``); either way only on a winner below its starting level's noise band in the collapse ``history``: one
        still on the untrained model's plateau says nothing about the LR, and a narrow grid around it under one
        shared gradient stays there (shapes from a 10x high start, benchmark 2). Where the starting level is unknown
        (``monitor``) it ends as asked."""
        if not (interval.refine or curves and self._evidence_is_in(interval, healthy)):
            return False
        winner = winner_of(interval.losses, healthy)
        return winner >= 0 and has_progressed(history, winner, interval.losses[winner])

    def _evidence_is_in(self, interval: Interval, healthy: Sequence[bool]) -> bool:
        """Whether a vote of the search before ``steps`` ends it (``Search.evidence``, :func:`curves_show_evidence`):
        only inside the search, on a vote whose curves may be judged (:meth:`ends_here`)."""
        search = self.search
        inside = self.steps is not None and self.searched_at is None and len(healthy) > 1
        if search is None or search.evidence is None or not inside or interval.curves is None:
            return False
        return curves_show_evidence(interval.curves.tolist(), interval.losses, healthy,
                                    interval.multipliers[:, 0].tolist(), search.refine_spread, search.evidence)

    def end(self, interval: Interval, row: list[float]) -> tuple[Tensor, list[bool], str]:
        """End the search at ``interval``'s vote around the winner's multipliers ``row``: the grid of ratio
        ``refine_spread`` centred on them, the groups that restart from the initial model (every group or none)
        and the warning when they should but no initial model is held. The caller starts its vote rule afresh (its
        velocity, spread or vote count described the search) and, on a restart, its collapse history."""
        restart, warning = self._restart(interval, row[0])
        self.searched_at = interval.step
        log.debug("search ended at step %d around multipliers %s", interval.step, row)
        return centred_grid(row, len(interval.losses), self.refine_spread), restart, warning

    def _restart(self, interval: Interval, centre: float) -> tuple[list[bool], str]:
        """Whether a search ending around the winner's multiplier ``centre`` restarts every group from the initial
        model (``Search.restart_below``), and the warning when it should but no initial model is held."""
        below = (self.search or Search()).restart_below
        self.restarted_at = None
        if below is None or centre > below * (1 + 1e-9):
            return [], ""
        if not interval.holds_initial:
            return [], (f"HDET: step {interval.step}: the search ended at {centre:.3g}x the optimizer's LR, at or "
                        f"below Search(restart_below={below:.3g}), but no initial model is held (a run resumed from a "
                        "checkpoint keeps none): every group trains on from the winner's model.")
        self.restarted_at = interval.step
        return [True] * len(interval.losses), ""

    def state_dict(self) -> dict[str, Optional[int]]:
        """What a checkpoint keeps, under the controller's keys."""
        return {"searched_at": self.searched_at, "restarted_at": self.restarted_at}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.searched_at = state_dict["searched_at"]
        self.restarted_at = state_dict.get("restarted_at")  # (absent from older checkpoints)
