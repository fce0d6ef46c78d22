"""``experimental.PB2``: population-based bandits as a vote rule, in one file (pure: no Lightning, no process groups).

What adding a vote rule takes: this file (the rule's options, their checks and its behaviour, on one frozen
dataclass built on :class:`~lightning_hdet.hdet.rules.selection.PBT`, itself a :class:`~lightning_hdet.hdet.rules.votes.Vote`)
and its test (tests/test_pb2.py). The controller, the callback and the run config know no rule by name.

PB2 (Parker-Holder et al. 2020, arXiv 2002.02518) keeps PBT's truncation (the bottom quantile copies a top group)
and replaces its random explore step: a Gaussian process over (interval, log learning rate) -> the improvement a
group made in that interval picks each mover's new multiplier by an upper confidence bound. The improvement is
what the interval's level cannot tell: a group copied from the leader starts where the leader ended, so it is
judged by how far it got from there, not by where it started.

Why the rewards are centred per interval: every group of an interval started from the same (or a copied) model
at the same point of the schedule, so the interval's common part (early intervals improve far more than late
ones) says nothing about the learning rate. Centring also makes the first vote usable: every group started from
the same model, so its rewards are its losses' distances below the mean.

The kernel is PB2's time-varying one (Bogunovic et al. 2016): a squared exponential in the normalised log LR
times ``(1 - epsilon) ** (|t - t'| / 2)``, so older intervals count less; its length scale and noise are the
pair of a small grid with the highest marginal likelihood.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_hdet._checks import check_int, check_number, require
from lightning_hdet.hdet.rules.selection import PBT, Selection
from lightning_hdet.hdet.rules.votes import Ballot, refill

# The (length scale, noise variance) pairs the marginal likelihood chooses from; inputs lie in [0, 1] and the
# rewards are standardised, so these cover "one bump over the range" to "nearly independent points", and "exact"
# to "mostly noise".
LENGTH_SCALES = (0.1, 0.2, 0.4, 0.8)
NOISES = (0.01, 0.1, 0.5)


def time_kernel(a: Tensor, b: Tensor, length_scale: float, epsilon: float) -> Tensor:
    """``k((t, x), (t', x')) = exp(-(x - x')^2 / (2 l^2)) * (1 - epsilon) ** (|t - t'| / 2)`` for rows ``(t, x)``."""
    dx = a[:, None, 1] - b[None, :, 1]
    dt = (a[:, None, 0] - b[None, :, 0]).abs()
    return torch.exp(-dx.square() / (2 * length_scale**2)) * (1 - epsilon) ** (dt / 2)


@dataclass(frozen=True)
class Posterior:
    """A Gaussian process's fit to ``(inputs, targets)``, unit signal variance: mean and std at new inputs."""

    inputs: Tensor  # (n, 2): interval, normalised log LR
    targets: Tensor  # (n,), standardised
    length_scale: float
    noise: float
    epsilon: float

    @cached_property
    def _factor(self) -> tuple[Tensor, Tensor]:
        """The Cholesky factor of the noisy Gram matrix and ``K^-1 targets``, once per posterior (the likelihood that
        chooses it and its predictions share them)."""
        gram = time_kernel(self.inputs, self.inputs, self.length_scale, self.epsilon)
        chol = torch.linalg.cholesky(gram + self.noise * torch.eye(len(self.inputs), dtype=torch.float64))
        return chol, torch.cholesky_solve(self.targets[:, None], chol)[:, 0]

    def log_likelihood(self) -> float:
        """``log p(targets)`` under this kernel and noise (what the grid of length scales and noises compares)."""
        chol, alpha = self._factor
        n = len(self.targets)
        return float(-0.5 * self.targets @ alpha - chol.diagonal().log().sum() - 0.5 * n * math.log(2 * math.pi))

    def predict(self, queries: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior mean and standard deviation of the noise-free function at ``queries`` (rows ``(t, x)``)."""
        chol, alpha = self._factor
        cross = time_kernel(queries, self.inputs, self.length_scale, self.epsilon)
        v = torch.linalg.solve_triangular(chol, cross.T, upper=False)
        return cross @ alpha, (1 - v.square().sum(0)).clamp_min(0).sqrt()


def fit(inputs: Tensor, targets: Tensor, epsilon: float) -> Posterior:
    """The posterior whose (length scale, noise) pair of the grid has the highest marginal likelihood (the first on
    ties)."""
    fits = [Posterior(inputs, targets, ls, noise, epsilon) for ls in LENGTH_SCALES for noise in NOISES]
    return max(fits, key=lambda p: p.log_likelihood())


def standardise(times: Sequence[int], rewards: Sequence[float]) -> list[float]:
    """Each reward minus its interval's mean, divided by the standard deviation of the result (1 if it is 0)."""
    by_time: dict[int, list[float]] = {}
    for t, r in zip(times, rewards):
        by_time.setdefault(t, []).append(r)
    centred = [r - sum(by_time[t]) / len(by_time[t]) for t, r in zip(times, rewards)]
    scale = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / scale if scale > 1e-12 else c for c in centred]


def ucb_picks(observations: Sequence[Sequence[float]], now: int, low: float, high: float, count: int,
              kappa: float, epsilon: float, candidates: int = 65) -> list[float]:
    """``count`` multipliers in ``[low, high]`` (log-spaced candidates), each maximising ``mean + kappa * std`` of
    the posterior at interval ``now``; after each pick the posterior takes its own mean there as an observation
    (so the next mover goes elsewhere: the batch form of GP-UCB)."""
    span = math.log(high) - math.log(low)
    times = [int(o[0]) for o in observations]
    targets = standardise(times, [o[2] for o in observations])
    inputs = [[float(t), (o[1] - math.log(low)) / span] for t, o in zip(times, observations)]
    grid = torch.linspace(0.0, 1.0, candidates, dtype=torch.float64)
    queries = torch.stack([torch.full_like(grid, float(now)), grid], dim=1)
    picks = []
    for _ in range(count):
        posterior = fit(torch.tensor(inputs, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64), epsilon)
        mean, std = posterior.predict(queries)
        best = int(torch.argmax(mean + kappa * std))
        picks.append(math.exp(math.log(low) + float(grid[best]) * span))
        inputs.append([float(now), float(grid[best])])
        targets.append(float(mean[best]))
    return picks


@dataclass(frozen=True)
class PB2(PBT):
    """Population-based bandits (Parker-Holder et al. 2020): PBT's selection, and a Gaussian-process bandit picks the
    movers' LRs by an upper confidence bound (see the module). Measured level with :class:`~lightning_hdet.PBT`.

    Args (beyond :class:`~lightning_hdet.PBT`'s; ``resample_probability`` applies only where no interval was
    observed yet):
        kappa: the bound's weight on the posterior's standard deviation (exploration).
        epsilon: how fast older intervals are forgotten, in [0, 1): their covariance decays as
            ``(1 - epsilon) ** (age / 2)``.
        window: observations kept (the most recent), which bounds the process's cost per vote.

    The candidates span what PBT's moves can reach from the current population: ``[min m * min(factors),
    max m * max(factors)]``, so the population can travel by ``max(factors)`` per vote beyond its ends. Before any
    observation (never, after the first vote's) it perturbs as PBT does. PBT's floor on the spread does not apply.
    """

    name: ClassVar[str] = "pb2"
    kappa: float = 1.0
    epsilon: float = 0.1
    window: int = 64
    # per key: [interval, log m, reward] rows; each group's loss where it started; intervals observed
    observations: dict[int, list[list[float]]] = field(default_factory=dict, init=False, repr=False, compare=False)
    starts: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)
    intervals: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("kappa", self.kappa, low=0.0)
        check_number("epsilon", self.epsilon, 0.0, 1.0, high_open=True)
        check_int("window", self.window, minimum=2)

    def check_signal(self, signal: Any) -> None:
        """PB2 measures each group's improvement itself, from one level to the next: it needs a level signal."""
        require("signal", signal.name, signal.level, "a level ('mean', Forecast() or Heldout()) with vote=PB2()",
                "PB2 measures each group's improvement itself, from one level to the next.")

    def explore(self, ballot: Ballot, generator: torch.Generator) -> Selection:
        self._observe(ballot)
        result = super().explore(ballot, generator)
        # A group starts the next interval where its source ended this one (itself, when it stays).
        self.starts[ballot.key] = [float(ballot.losses[s]) for s in result.sources]
        return result

    def _observe(self, ballot: Ballot) -> None:
        """Record every healthy group's (interval, log multiplier, improvement) for the interval that just ended.
        Without a recorded start (the first vote, or after the rule's state was reset) every group started from
        the same model: the improvement is the negative loss, which the per-interval centring makes relative."""
        key, n = ballot.key, len(ballot.losses)
        starts = self.starts.get(key)
        if starts is None or len(starts) != n:
            starts = [0.0] * n
        t = self.intervals.get(key, 0)
        rows = self.observations.setdefault(key, [])
        for g, (loss, start) in enumerate(zip(ballot.losses, starts)):
            reward = start - loss
            if ballot.healthy[g] and math.isfinite(reward):
                rows.append([float(t), math.log(ballot.multipliers[g]), float(reward)])
        del rows[: max(len(rows) - self.window, 0)]
        self.intervals[key] = t + 1

    def _moves(self, ballot: Ballot, pairs: dict[int, int], generator: torch.Generator) -> dict[int, float]:
        rows = self.observations.get(ballot.key, [])
        low = min(ballot.multipliers) * min(self.factors)
        high = max(ballot.multipliers) * max(self.factors)
        if not rows or not pairs or high <= low:  # (an empty range: factors (1, 1) and one multiplier for all)
            return super()._moves(ballot, pairs, generator)
        picks = ucb_picks(rows, self.intervals[ballot.key], low, high, len(pairs), self.kappa, self.epsilon)
        return dict(zip(pairs, picks))

    def _keep_spread(self, multipliers: list[float], leader: int, movers: list[int], travel: float = 0.0) -> None:
        """No floor on the spread nor travel: it would overrule the bound whenever the leader sits at an end of the population
        (with one mover per vote, most votes); the bound's exploration term keeps the groups apart instead."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), "observations": {k: [list(r) for r in v] for k, v in self.observations.items()},
                "starts": {k: list(v) for k, v in self.starts.items()}, "intervals": dict(self.intervals)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        refill(self.observations, {int(k): [list(map(float, r)) for r in v]
                                    for k, v in state.get("observations", {}).items()})
        refill(self.starts, {int(k): [float(x) for x in v] for k, v in state.get("starts", {}).items()})
        refill(self.intervals, {int(k): int(v) for k, v in state.get("intervals", {}).items()})
