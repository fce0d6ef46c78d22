"""Population-based selection as a vote rule (pure: no Lightning, no process groups).

PBT (Jaderberg et al. 2017, arXiv 1711.09846) with Ray Tune's defaults: at each vote only the bottom quantile of
groups moves. Each of them copies a top-quantile group's parameters (exploit) and takes that group's multiplier
times 0.8 or 1.2 at random, or, with probability ``resample_probability``, a log-uniform draw over the current
range (explore). The other groups keep their parameters and learning rates, so one unlucky vote cannot drag the
whole population toward the lowest learning rate the way re-centring every group on the winner does.

The spread never collapses: after the moves, if no group sits at least ``exp(min_spread)`` above (below) the
leader, a mover is placed there, upward first. An edge of the LRs tried that keeps winning (the highest, or the
lowest, leads two votes in a row, the search's end between them or not) gets its probe one step of the grid's own
spacing beyond it instead, so the grid travels that way geometrically, as far as the user's LR was off. A vote on
which no group has learned yet (``Ballot.direction``) is a tie that names its edge: every LR too low (no group
failed) or too high (some group blew up); half the groups then probe one and two spacings beyond that edge at once
(a CNN with SGD 40x off sat at chance on ties to the end of the run: issue 59).

The parameter moves are a :class:`MergePlan`: steps the strategy's ``merge(coefficients, strengths)`` executes
as they are, one all-reduce each (one per distinct copy source: one for up to seven groups).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from lightning_hdet._checks import check_number, require
from lightning_hdet.hdet.rules.votes import Ballot, Vote, VoteResult, edge_of, refill, winner_of


# Votes in a row an edge of the LRs must lead before the grid travels past it: a first lead is often noise (from the
# right LR the first vote's top group won by 0.6 % and a probe 27x above it diverged: tests/test_insurance_fit.py).
TRAVEL_AFTER = 2


@dataclass
class MergeStep:
    """One collective: ``target = sum_h coefficients[h] * theta_h``; ``theta_g <- (1 - s_g) theta_g + s_g target``."""

    coefficients: list[float]
    strengths: list[float]


MergePlan = list[MergeStep]


def copy_plan(sources: Sequence[int], strength: float = 1.0, rescued: Sequence[bool] = ()) -> MergePlan:
    """The merge steps that copy ``sources[g]`` into group ``g`` (``sources[g] == g``: left alone).

    One step per distinct source, in increasing source order; a rescued group takes its source fully. Sources are
    never targets of another copy in the same plan, so the order of the steps does not matter.
    """
    n = len(sources)
    rescued = list(rescued) or [False] * n
    movers = {g: s for g, s in enumerate(sources) if s != g}
    require("sources", list(sources), not set(movers) & set(movers.values()),
            "a copy plan whose sources are not themselves copied into")
    plan: MergePlan = []
    for src in sorted(set(movers.values())):
        coefficients = [1.0 if h == src else 0.0 for h in range(n)]
        strengths = [(1.0 if rescued[g] else strength) if movers.get(g) == src else 0.0 for g in range(n)]
        plan.append(MergeStep(coefficients, strengths))
    return plan


def plan_matrix(plan: MergePlan, num_groups: int) -> list[list[float]]:
    """The ``G x G`` mixing matrix ``M`` the plan applies (``theta' = M theta``), composed step by step."""
    matrix = [[1.0 if g == h else 0.0 for h in range(num_groups)] for g in range(num_groups)]
    for step in plan:
        target = [sum(step.coefficients[k] * matrix[k][h] for k in range(num_groups)) for h in range(num_groups)]
        matrix = [[(1 - s) * matrix[g][h] + s * target[h] for h in range(num_groups)]
                  for g, s in enumerate(step.strengths)]
    return matrix


@dataclass
class Selection(VoteResult):
    """A vote result that also says which group each group copies (``sources[g] == g``: keeps its own)."""

    sources: list[int] = field(default_factory=list)


def quantile_size(num_groups: int, quantile: float) -> int:
    """Groups in the bottom (and in the top) quantile: ``ceil(G * q)``, at least 1 for G >= 2, at most G // 2."""
    if num_groups < 2:
        return 0
    return min(max(math.ceil(num_groups * quantile), 1), num_groups // 2)


@dataclass(frozen=True)
class PBT(Vote):
    """Population-based training's truncation selection (the default vote, it searches): at each vote the bottom
    ``quantile`` of groups copies a top group's parameters and takes its LR x0.8 / x1.2, or with probability
    ``resample_probability`` a fresh log-uniform one (Ray Tune's defaults). Copies, never blends.

    Args:
        quantile: share of groups that move (bottom) and are copied (top), in (0, 0.5].
        resample_probability: chance of a fresh LR (log-uniform over the current range) instead of x0.8 / x1.2, in
            [0, 1].
        factors: the two perturbation factors, picked at random (Ray Tune: 0.8 and 1.2).
        min_spread: log-distance from the leader's multiplier kept on each side by some group (> 0).
        travel: an edge of the LRs that led two votes in a row gets its probe one step of the grid's spacing beyond
            it, and on a vote with a ``Ballot.direction`` half the groups probe beyond the edge it names
            (``False``: ``min_spread`` beyond, as any leader).
    """

    name: ClassVar[str] = "pbt"
    copies: ClassVar[bool] = True
    quantile: float = 0.25
    resample_probability: float = 0.25
    factors: tuple[float, float] = (0.8, 1.2)
    min_spread: float = math.log(1.2)
    travel: bool = True
    # Per ballot key: +n (-n) when the highest (lowest) LR voted on led the last n votes, 0 otherwise.
    streaks: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_number("quantile", self.quantile, 0.0, 0.5, low_open=True)
        check_number("resample_probability", self.resample_probability, 0.0, 1.0)
        require("factors", self.factors, len(self.factors) == 2 and all(
            isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in self.factors),
            "two positive finite numbers")
        check_number("min_spread", self.min_spread, low=0.0, low_open=True)
        require("travel", self.travel, isinstance(self.travel, bool), "True or False")

    def rank(self, ballot: Ballot) -> list[int]:
        """Groups from best to worst: healthy ones by loss (lowest index on ties), then the unhealthy ones."""
        n = len(ballot.losses)
        def key(g: int) -> tuple:
            ok = ballot.healthy[g] and math.isfinite(ballot.losses[g])
            return (0, ballot.losses[g], g) if ok else (1, 0.0, g)
        return sorted(range(n), key=key)

    def pairs(self, ballot: Ballot, k: Optional[int] = None) -> dict[int, int]:
        """``{mover: source}``: the k-th worst copies the k-th best; every unhealthy group moves too. ``k``: how
        many move (``None``: the ``quantile``'s share)."""
        order = self.rank(ballot)
        healthy = [g for g in order if ballot.healthy[g] and math.isfinite(ballot.losses[g])]
        k = quantile_size(len(order), self.quantile) if k is None else k
        candidates = list(reversed(order))
        movers = [g for g in candidates if g not in healthy]
        movers += [g for g in candidates if g in healthy and g not in movers][: max(k - len(movers), 0)]
        sources = [g for g in healthy if g not in movers][: max(k, 1)]
        return {g: sources[i % len(sources)] for i, g in enumerate(movers)} if sources else {}

    def explore(self, ballot: Ballot, generator: torch.Generator) -> Selection:
        n = len(ballot.losses)
        winner = winner_of(ballot.losses, ballot.healthy)
        weights = [1.0 if g == winner else 0.0 for g in range(n)]
        multipliers = list(ballot.multipliers)
        # No group has learned yet (Ballot.direction): the losses are ties, the edge it names leads (the streak too).
        direction = ballot.direction if winner >= 0 and n >= 2 else 0
        leader = max(range(n), key=lambda g: (direction * multipliers[g], -g)) if direction else winner
        # (every vote counts into the streak, the search's last one too: it moves nothing, its winner is an edge)
        streak = self._streak(ballot, leader) if winner >= 0 and n >= 2 else 0
        if not ballot.move or winner < 0 or n < 2:
            return Selection(weights, winner, multipliers, list(range(n)))
        far = abs(streak) >= TRAVEL_AFTER or direction != 0
        travel = self._spacing(ballot, leader) if self.travel and far else 0.0
        # On ties any group is as good as another: half of them probe beyond the edge (twice the reach of one).
        pairs = self.pairs(ballot, n // 2 if direction and travel > 0 else None)
        for g, m in self._moves(ballot, pairs, generator).items():
            multipliers[g] = m
        self._keep_spread(multipliers, ballot.multipliers[leader], list(pairs), travel, direction)
        return Selection(weights, winner, multipliers, [pairs.get(g, g) for g in range(n)])

    def _moves(self, ballot: Ballot, pairs: dict[int, int], generator: torch.Generator) -> dict[int, float]:
        """Each mover's new multiplier (the explore step): its source's, perturbed. Sources never move, so they
        are read from the ballot."""
        low, high = min(ballot.multipliers), max(ballot.multipliers)
        return {g: self._perturb(ballot.multipliers[src], low, high, generator) for g, src in pairs.items()}

    def _perturb(self, source: float, low: float, high: float, generator: torch.Generator) -> float:
        draws = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        if draws[0] < self.resample_probability:
            log_low = min(math.log(low), math.log(source) - self.min_spread)
            log_high = max(math.log(high), math.log(source) + self.min_spread)
            return math.exp(log_low + draws[1] * (log_high - log_low))
        return source * (self.factors[0] if draws[1] < 0.5 else self.factors[1])

    def _streak(self, ballot: Ballot, winner: int) -> int:
        """Count this vote into the edge streak of ``ballot.key``: the winner the highest LR voted on extends a run of
        top wins, the lowest one a run of bottom wins; anything else ends it."""
        edge, last = edge_of(ballot.multipliers, winner), self.streaks.get(ballot.key, 0)
        self.streaks[ballot.key] = edge * (abs(last) + 1) if edge and edge * last > 0 else edge
        return self.streaks[ballot.key]

    @staticmethod
    def _spacing(ballot: Ballot, leader: int) -> float:
        """The grid's spacing at the leader: the log-distance to its nearest other group, as voted on."""
        lead = ballot.multipliers[leader]
        gaps = [abs(math.log(m / lead)) for g, m in enumerate(ballot.multipliers) if g != leader]
        return min((d for d in gaps if d > 1e-12), default=0.0)

    def _keep_spread(self, multipliers: list[float], lead: float, movers: list[int], travel: float = 0.0,
                     direction: int = 0) -> None:
        """Place movers so some group sits ``exp(min_spread)`` above the leader's multiplier ``lead`` (as voted on:
        on a vote with a ``direction`` the leader may be a mover itself) and some below (up first); an edge that
        keeps winning (``travel``: the grid's spacing there) gets its probe that far beyond instead. The default
        search's grid (2.28x apart) then walks 2.28x a vote and the grid after it 1.5x, where x1.2 a vote took a
        start 40x off the whole run (issue 59). With a ``direction`` (no group learned yet) every mover probes that
        way, one, two, ... spacings beyond the edge."""
        if direction and travel > 0:
            for j, g in enumerate(sorted(movers), start=1):
                multipliers[g] = lead * math.exp(direction * travel * j)
            return
        step = max(self.min_spread, travel)
        up, down = lead * math.exp(step), lead * math.exp(-step)
        free = list(movers)
        if free and not any(m >= up * (1 - 1e-12) for m in multipliers):
            g = max(free, key=lambda h: (multipliers[h], -h))
            multipliers[g] = up
            free.remove(g)
        if free and not any(m <= down * (1 + 1e-12) for m in multipliers):
            g = min(free, key=lambda h: (multipliers[h], h))
            multipliers[g] = down

    def state_dict(self) -> dict:
        # (no streak yet: the key is left out, as checkpoints before it had none)
        return {"streaks": dict(self.streaks)} if self.streaks else {}

    def load_state_dict(self, state: dict) -> None:
        refill(self.streaks, {int(k): int(v) for k, v in state.get("streaks", {}).items()})  # (absent: older files)

    def carried(self) -> dict:
        """An edge that won the search's last vote and wins the first after it keeps winning: the streak goes on."""
        return {"streaks": dict(self.streaks)}
