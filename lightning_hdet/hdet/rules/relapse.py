"""After a relapse: the LRs the ensemble rolls back at, and the ceiling it may not climb to again (pure: no Lightning,
no process groups).

A CNN with SGD + momentum above about 2-3x its good LR learns fastest early and then falls back to chance: a search
that follows the early leader walks the grid there, and the whole ensemble relapses to its untrained loss
(:func:`~lightning_hdet.hdet.rules.collapse.judge`'s ``relapsed``; issue 59). Halving every LR from the collapsed
grid left some groups at LRs that had just collapsed, and the plateau rule's ladder, where it fired instead, cut
every LR 10-100x, too low to learn again in the run that was left. So after a relapse every group rolls back to the
last good merge (the roll-back point) onto a grid *at and below* the LR that made it:

* the **ceiling** is the lowest real LR (multiplier x schedule LR, per param group) at which a group relapsed; it is
  kept for the rest of the run (the lowest of every relapse), and no vote may move a group's LR above one grid step
  (``step``) below it;
* the **grid** after the roll-back starts at the winner's real LR at the vote that made the roll-back point
  (:meth:`RelapseMemory.remember`), or one step below the ceiling where that is lower, and descends ``step`` a group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass
class RelapseMemory:
    """Per param group: the real LR that made the roll-back point (the last good merge's winner) and the ceiling
    (NaN: none yet)."""

    good: list[float] = field(default_factory=list)
    ceiling: list[float] = field(default_factory=list)

    def remember(self, multipliers: Sequence[float], schedule_lrs: Sequence[float]) -> None:
        """The roll-back point was just made by a group at these multipliers (before the vote moved them)."""
        self.good = [float(m) * float(lr) for m, lr in zip(multipliers, schedule_lrs)]

    def __bool__(self) -> bool:
        """Whether anything is remembered yet."""
        return bool(self.good or self.ceiling)

    def state_dict(self) -> dict:
        return {"good": list(self.good), "ceiling": list(self.ceiling)}

    def load_state_dict(self, state: dict) -> None:
        self.good = [float(v) for v in state.get("good", [])]
        self.ceiling = [float(v) for v in state.get("ceiling", [])]


def after_relapse(memory: RelapseMemory, multipliers: Tensor, schedule_lrs: Sequence[float],
                  step: float) -> Tensor:
    """The ``G x P`` multiplier table every group rolls back at, with ``memory``'s ceiling lowered to the relapsed
    LRs (in place). Per column: rungs ``top / step ** k``, ``top`` the smaller of the good LR and one ``step`` below
    the ceiling, handed out in the order of the current multipliers (the highest group gets ``top``)."""
    table = multipliers.clone().to(torch.float64)
    num_groups, columns = table.shape
    lowest = [float(table[:, p].min()) * float(schedule_lrs[p]) for p in range(columns)]
    old = memory.ceiling if len(memory.ceiling) == columns else [math.nan] * columns
    memory.ceiling = [x if not math.isfinite(c) else min(c, x) for c, x in zip(old, lowest)]
    for p in range(columns):
        schedule = float(schedule_lrs[p])
        if not schedule > 0:
            continue
        top = memory.ceiling[p] / step
        if p < len(memory.good) and math.isfinite(memory.good[p]) and memory.good[p] > 0:
            top = min(top, memory.good[p])
        order = sorted(range(num_groups), key=lambda g: (-float(multipliers[g, p]), g))
        for k, g in enumerate(order):
            table[g, p] = top / step**k / schedule
    return table


def capped(memory: RelapseMemory, multipliers: Tensor, schedule_lrs: Sequence[float], step: float) -> Tensor:
    """``multipliers`` with every real LR at most one ``step`` below ``memory``'s ceiling (unchanged without one)."""
    if len(memory.ceiling) != multipliers.shape[1]:
        return multipliers
    table = multipliers.clone()
    for p, ceiling in enumerate(memory.ceiling):
        schedule = float(schedule_lrs[p])
        if math.isfinite(ceiling) and schedule > 0:
            table[:, p] = table[:, p].clamp(max=ceiling / step / schedule)
    return table


def steered(memory: RelapseMemory, table: Tensor, before: Tensor, schedule_lrs: Sequence[float], step: float,
            relapsed: bool, kept: Optional[Sequence[float]]) -> Tensor:
    """The multiplier table a vote ends on: ``table`` (the vote's), or after a relapse of every group
    :func:`after_relapse` of the table the groups relapsed at (``before``), either one :func:`capped`. ``kept``: the
    winner's multipliers before the vote where its merge becomes the roll-back point (``memory`` remembers them)."""
    if relapsed:
        table = after_relapse(memory, before, schedule_lrs, step)
    table = capped(memory, table, schedule_lrs, step)
    if kept is not None:
        memory.remember(kept, schedule_lrs)
    return table
