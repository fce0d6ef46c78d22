"""Successive halving inside one job (ASHA/Hyperband's idea; issue 41): a vote rule, pure.

At each vote the losing half of the groups copies the winning half's models and takes their rates unchanged (no
perturbation, no spread kept). Under ``HDETStrategy(gradient_sync="cluster")`` a group that copied another whole
joins its cluster (:mod:`~lightning_hdet.hdet.clusters`), so the losers' ranks train the winners' LRs on more of
the batch, and after about ``log2(G)`` votes the job is one DDP run on the best LR. Without clusters it is PBT
without exploration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lightning_hdet.hdet.rules.selection import PBT
from lightning_hdet.hdet.rules.votes import Ballot


@dataclass(frozen=True)
class Halving(PBT):
    """The bottom ``quantile`` of groups (default half) copies the top ones, models and rates, unperturbed.

    Args:
        quantile: share of groups that move (bottom) and are copied (top), in (0, 0.5].
    """

    name: ClassVar[str] = "halving"
    quantile: float = 0.5

    def _moves(self, ballot: Ballot, pairs: dict[int, int], generator: torch.Generator) -> dict[int, float]:
        return {g: ballot.multipliers[src] for g, src in pairs.items()}

    def _keep_spread(self, multipliers: list[float], lead: float, movers: list[int], travel: float = 0.0,
                     direction: int = 0) -> None:
        """Nothing: halving narrows the population on purpose."""
