"""A trust region of learning rates around one incumbent, as a vote rule (pure: no Lightning, no process groups).

Cheap when the LR is right, travels when it is wrong (issue 28): two *edge* groups probe ``incumbent / r`` and
``incumbent * r``; every other group trains at the incumbent itself (with ``gradient_sync="global"`` every group
sees the whole batch, so from a good start the job is close to plain DDP at that LR). After each vote:

* an **edge wins**: the incumbent steps to it; if the same edge won the vote before too, the region grows
  (``log r`` times ``grow``, up to ``max_ratio``): geometric travel from a bad start, about ``r, r**2, r**4`` per
  vote;
* the **centre wins**: the region shrinks (``log r`` times ``shrink``, down to ``min_ratio``) and the streak ends:
  the probes settle close to the incumbent, so the edges cost less and less once the LR is right.

A region never shrinks below ``min_ratio``, so the rule keeps probing (an LR that was right early can be wrong
later). Groups keep their slot: group ``0`` is the low edge, group ``G - 1`` the high edge, the others the centre
(with two groups there is no centre: the region shrinks when the winning edge changes sides).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from lightning_hdet._checks import check_choice, check_number, require
from lightning_hdet.hdet.rules.blends import BLENDS
from lightning_hdet.hdet.rules.votes import Ballot, Vote, VoteResult, refill, winner_of


@dataclass
class RegionState:
    """One param group's region: the incumbent multiplier, the ratio ``r`` and which edge won last (-1, 0, +1)."""

    incumbent: float
    ratio: float
    last_edge: int = 0


def slot(group: int, num_groups: int) -> int:
    """Where group ``group`` sits: ``-1`` the low edge (group 0), ``+1`` the high edge (the last), ``0`` the centre."""
    if group == 0:
        return -1
    return 1 if group == num_groups - 1 else 0


@dataclass(frozen=True)
class TrustRegion(Vote):
    """A trust region of LRs around one incumbent (see the module): two edge groups probe ``incumbent / r`` and
    ``incumbent * r``, the others train at the incumbent; a winning edge moves the incumbent (twice in a row: ``r``
    grows), the centre winning shrinks ``r``; every group then blends toward ``blend``. Cheap when the LR is right
    only if the centre groups share one gradient, so it needs ``HDETStrategy(gradient_sync="global")`` (refused
    with ``"group"``), and it explores the LR alone (refused with ``explore=...``).

    Args:
        ratio: the starting ``r`` (> 1, within ``[min_ratio, max_ratio]``).
        grow: factor on ``log r`` when the same edge wins twice in a row (>= 1).
        shrink: factor on ``log r`` when the centre wins, in (0, 1].
        min_ratio: the smallest ``r`` (> 1: the edges never merge with the centre).
        max_ratio: the largest ``r`` (>= ``min_ratio``).
        blend: merge target: ``"mean"``, ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "trust_region"
    ratio: float = 2.0
    grow: float = 2.0
    shrink: float = 0.5
    min_ratio: float = 1.1
    max_ratio: float = 10.0
    blend: str = "mean"
    regions: dict[int, RegionState] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_number("ratio", self.ratio, low=1.0, low_open=True)
        check_number("grow", self.grow, low=1.0)
        check_number("shrink", self.shrink, 0.0, 1.0, low_open=True)
        check_number("min_ratio", self.min_ratio, low=1.0, low_open=True)
        check_number("max_ratio", self.max_ratio, low=self.min_ratio)
        require("ratio", self.ratio, self.min_ratio <= self.ratio <= self.max_ratio,
                f"within [min_ratio, max_ratio] = [{self.min_ratio}, {self.max_ratio}]")
        check_choice("blend", self.blend, BLENDS)

    def check_strategy(self, gradient_sync: str, explored: Sequence[str]) -> None:
        """Refuse a run with no point: the centre groups train at one LR, which is plain DDP at that LR only when
        they share one gradient (``"global"``; under ``"group"`` they would be separate runs of the same LR, each on
        a fraction of the batch); and its two edge groups would probe every explored hyperparameter at once."""
        require("gradient_sync", gradient_sync, gradient_sync == "global", "'global' with vote=TrustRegion(...)",
                "Under 'group' its centre groups are separate runs at one LR, not the cheap plain-DDP run it is meant "
                "to be: pass HDETStrategy(gradient_sync='global') or another vote (e.g. 'pbt').")
        names = list(explored)
        require("vote", self.name, not names, f"not 'trust_region' with explore={names}",
                "Its two edge groups would probe every hyperparameter at once; use vote='pbt' (or another vote).")

    def layout(self, region: RegionState, num_groups: int) -> list[float]:
        """Every group's multiplier: ``incumbent * r ** slot``."""
        return [region.incumbent * region.ratio ** slot(g, num_groups) for g in range(num_groups)]

    def explore(self, ballot: Ballot, generator: torch.Generator) -> VoteResult:
        n = len(ballot.losses)
        require("num_groups", n, n >= 2, "at least 2 with vote='trust_region'", "Two edges and a centre need 3.")
        winner = winner_of(ballot.losses, ballot.healthy)
        weights = [1.0 if g == winner else 0.0 for g in range(n)]
        region = self.regions.get(ballot.key)
        if region is None:  # the first vote: centred on the geometric mean of the starting multipliers
            centre = math.exp(sum(math.log(m) for m in ballot.multipliers) / n)
            region = self.regions[ballot.key] = RegionState(centre, self.ratio)
        if not ballot.move or winner < 0:
            return VoteResult(weights, winner, list(ballot.multipliers))
        self._step(region, slot(winner, n), n)
        return VoteResult(weights, winner, self.layout(region, n))

    def _step(self, region: RegionState, edge: int, num_groups: int) -> None:
        """Move the region after a vote won at ``edge`` (-1, 0 or +1)."""
        log_r = math.log(region.ratio)
        if edge == 0 or (num_groups == 2 and region.last_edge == -edge):
            log_r *= self.shrink
            edge = 0 if num_groups > 2 else edge
        elif edge == region.last_edge:
            log_r *= self.grow
        if edge != 0:
            region.incumbent *= region.ratio ** edge  # to the winning edge, at the ratio it won with
        region.ratio = min(max(math.exp(log_r), self.min_ratio), self.max_ratio)
        region.last_edge = edge

    def state_dict(self) -> dict:
        return {"regions": {k: [r.incumbent, r.ratio, r.last_edge] for k, r in self.regions.items()}}

    def load_state_dict(self, state: dict) -> None:
        refill(self.regions, {int(k): RegionState(float(v[0]), float(v[1]), int(v[2]))
                               for k, v in state.get("regions", {}).items()})
