"""Where the LRs must go while no group has learned yet (pure: no Lightning, no process groups).

Early in a run, or from a start far off, no group may have left the untrained loss: the vote's losses are then ties,
and the lowest by noise would win (a CNN with SGD 40x too low sat at chance on such ties to the end: issue 59). The
losses still name a direction (:attr:`~lightning_hdet.hdet.rules.votes.Ballot.direction`, which PBT travels):

* **down** when every healthy group rose above its starting level's band, by the vote's loss or by any bin of its
  training-loss curve (a blow-up that a vote on ``monitor`` no longer shows in the validation it reads later): each
  LR tried is too high. The groups that probe below the grid restart from the initial model (:func:`below_grid`):
  the model a too-high LR left is often dead, as the plateau ladder's lower half finds;
* **up** when no group has ever risen and the safety net is not armed: each LR tried is too low to show anything
  yet (a too-high LR shows itself by failing, and the plateau rule then searches down);
* otherwise the vote decides: a group that rose beside flat ones says only that its own LR is too high.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from torch import Tensor

from lightning_hdet.hdet.rules.collapse import CollapseHistory, none_progressed, risen
from lightning_hdet.hdet.rules.signals import bin_means


def risen_now(history: CollapseHistory, losses: Sequence[float], curves: Optional[Tensor]) -> list[bool]:
    """Which groups rose above their starting level's band at this vote (:func:`~.collapse.risen`): by the vote's
    loss, or by the highest bin mean of their training-loss curve (``curves``: one gathered row per group)."""
    rose = risen(history, losses)
    if curves is None:
        return rose
    peaks = [max((m for _, m in bin_means(row)), default=-math.inf) for row in curves.tolist()]
    return [a or b for a, b in zip(rose, risen(history, peaks))]


def direction(history: CollapseHistory, losses: Sequence[float], healthy: Sequence[bool], rose: Sequence[bool],
              failed_before: bool) -> int:
    """-1 (down), +1 (up) or 0 (the vote decides), as the module says. ``rose``: :func:`risen_now`;
    ``failed_before``: a group rose or was caught at an earlier vote, or the safety net is armed."""
    if not none_progressed(history, losses, healthy):
        return 0
    if all(r for r, ok in zip(rose, healthy) if ok):
        return -1
    return 0 if failed_before or any(rose) else 1


def below_grid(voted: Sequence[float], moved: Sequence[float], sources: Sequence[int]) -> list[bool]:
    """The movers (``sources[g] != g``) whose new multiplier ``moved[g]`` lies below every multiplier ``voted`` on:
    on a vote that travels down they restart from the initial model. Empty where none does."""
    lowest = min(voted)
    below = [sources[g] != g and moved[g] < lowest * (1 - 1e-9) for g in range(len(sources))]
    return below if any(below) else []
