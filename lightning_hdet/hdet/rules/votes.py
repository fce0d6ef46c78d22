"""Vote rules: how the groups' losses move their learning rates (pure: no Lightning, no process groups).

A vote rule is one object (:class:`Vote`): its options are dataclass fields checked on creation, and its behaviour is
:meth:`Vote.explore`, called once per vote and per optimizer param group with a :class:`Ballot` (every group's
interval loss and current multiplier, and which groups are healthy). It returns the vote weights, the winner and the
new multipliers. The object the user passes is the one the controller runs: the controller takes a fresh copy
(:meth:`Vote.fresh`, the same options and no state) so one object can configure many runs, and that copy keeps its
state (velocity, spread) per param group, checkpointed through ``state_dict``. This module holds the base and the
two blending votes :class:`Softmax` and :class:`Best`; PBT is in :mod:`~lightning_hdet.hdet.rules.selection`, the trust
region in :mod:`~lightning_hdet.hdet.rules.trust_region`.

Multipliers are relative to the schedule's learning rate ``lr_t`` (what the optimizer and schedulers say), so
group ``g`` trains with ``lr_t * multipliers[g]``. The *base* LR is ``lr_t * mean(multipliers)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar, Optional

import torch

from lightning_hdet._checks import KnownArguments, check_bool, check_choice, check_number, check_positive
from lightning_hdet.hdet.rules.blends import BLENDS

# The controller never moves the base LR by more than this factor in one vote (keeps it positive and finite).
MAX_BASE_LR_CHANGE = 2.0


@dataclass
class VoteResult:
    """Outcome of one vote for one param group."""

    weights: list[float]
    winner: int
    multipliers: list[float]


def softmax_weights(losses: Sequence[float], healthy: Sequence[bool], temperature: float) -> list[float]:
    """``w_g = softmax_g((mean L - L_g) / temperature)`` over the healthy groups; unhealthy groups get 0."""
    idx = [g for g, ok in enumerate(healthy) if ok]
    if not idx:
        return [0.0] * len(losses)
    mean = sum(losses[g] for g in idx) / len(idx)
    logits = torch.tensor([(mean - losses[g]) / temperature for g in idx], dtype=torch.float64)
    probs = torch.softmax(logits, dim=0).tolist()
    weights = [0.0] * len(losses)
    for g, p in zip(idx, probs):
        weights[g] = p
    return weights


def edge_of(multipliers: Sequence[float], winner: int) -> int:
    """Where ``winner`` stands among the LRs voted on: 1 the highest, -1 the lowest, 0 inside (or no winner, or all
    alike). An edge that keeps winning says the best LR lies beyond what was tried: PBT travels past it, and the
    result's summary says so."""
    if winner < 0 or max(multipliers) <= min(multipliers) * (1 + 1e-9):
        return 0
    m = multipliers[winner]
    return 1 if m >= max(multipliers) * (1 - 1e-9) else -1 if m <= min(multipliers) * (1 + 1e-9) else 0


def winner_of(losses: Sequence[float], healthy: Sequence[bool]) -> int:
    """The healthy group with the lowest loss (the lowest index on ties); -1 if none is healthy."""
    idx = [g for g, ok in enumerate(healthy) if ok]
    return min(idx, key=lambda g: (losses[g], g)) if idx else -1


def symmetric_positions(n: int) -> list[float]:
    """``n`` evenly spaced points in ``[-1, 1]`` (the fan-out's shape)."""
    if n == 1:
        return [0.0]
    return [-1.0 + 2.0 * k / (n - 1) for k in range(n)]


@dataclass(frozen=True)
class Ballot(KnownArguments):
    """What one vote sees for one optimizer param group."""

    key: int  # which param group: rules keep their state (velocity, spread) per key
    losses: Sequence[float]  # every group's loss signal
    multipliers: Sequence[float]  # every group's current multiplier
    healthy: Sequence[bool]  # groups the safety net did not catch
    schedule_lr: float  # the LR the optimizer/scheduler says for this param group
    move: bool  # False before ``warmup_steps`` and at the final merge: weigh, but leave the LRs alone
    # No group has learned yet (collapse.none_progressed), so the losses are ties; where the LRs must go: +1 up (none
    # failed: all too low to show anything yet), -1 down (some group blew up or rose above the untrained loss: too
    # high), 0 the vote decides.
    direction: int = 0


class Vote(KnownArguments):
    """Base of the vote rules: ``explore`` turns one vote's losses into weights, a winner and new multipliers.

    A subclass is a frozen dataclass: its options are fields checked in ``__post_init__`` (errors name the argument),
    its state (per ballot key) fields with ``init=False`` that :meth:`state_dict` and :meth:`load_state_dict` carry.
    What the controller asks of a rule besides ``explore``:

    * ``name``: the rule's name (``vote="pbt"``, the console line, the run config);
    * ``copies``: the bottom groups copy a top group (truncation selection) instead of every group blending; such a
      vote also ends the run on its best group;
    * ``blend`` / ``strength``: what a blending vote merges toward (:mod:`~lightning_hdet.hdet.rules.blends`) and how far
      each group moves toward it;
    * :meth:`check_signal`, :meth:`check_strategy`: refuse a signal (on creation of the callback) or a strategy (at
      its set-up) the rule has no point with.
    """

    name: ClassVar[str] = ""
    copies: ClassVar[bool] = False
    blend = "mean"  # (a field of the blending votes; a copying vote merges so only before warm-up)
    strength = 1.0  # (experimental.PartialMerge: a partial merge)

    def explore(self, ballot: Ballot, generator: torch.Generator) -> VoteResult:
        raise NotImplementedError

    def fresh(self) -> "Vote":
        """This rule with the same options and no state (what one controller runs)."""
        return replace(self)  # type: ignore[type-var]

    def check_signal(self, signal: Any) -> None:
        """Refuse a signal (:class:`~lightning_hdet.hdet.rules.options.Signal`) this rule cannot vote on; any by default."""

    def check_strategy(self, gradient_sync: str, explored: Sequence[str]) -> None:
        """Refuse a strategy's ``gradient_sync`` or explored hyperparameters' names this rule has no point with; any
        by default."""

    def options(self) -> dict[str, Any]:
        """The options as given (recorded in the run config with the rule's name)."""
        return {"name": self.name, **recorded(self)}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def carried(self) -> dict:
        """The part of :meth:`state_dict` that outlives the search's end (the rest described the search's grid)."""
        return {}


def recorded(rule: Any) -> dict[str, Any]:
    """A rule object's options (its ``__init__`` fields), nested rule objects as dicts, for the run config."""
    out: dict[str, Any] = {}
    for f in fields(rule):
        if f.init:
            value = getattr(rule, f.name)
            out[f.name] = recorded(value) if is_dataclass(value) and not isinstance(value, type) else value
    return out


def refill(target: dict, values: dict) -> None:
    """Replace a state dict's contents in place (the rules are frozen; their state dicts are not)."""
    target.clear()
    target.update(values)


@dataclass(frozen=True)
class Softmax(Vote):
    """The published auto-LR controller (ALGORITHMS.md §1.1): softmax weights of the losses move the base LR with
    momentum; every group then blends toward ``blend``. One independent controller per param group.

    ``delta = sum_g w_g * lr_g - mean_g lr_g``; ``v <- momentum * v + (1 - momentum) * delta``;
    ``base <- base + meta_lr * v``, bounded to ``[base / 2, base * 2]`` so it stays positive and finite; then every
    group gets ``base * shape[perm(g)]`` where ``shape`` are the relative multipliers (mean 1) and ``perm`` a fresh
    random permutation (if ``permute``). Means are over healthy groups only.

    Args:
        temperature: softmax temperature, in the loss's own units (published 0.1; pick about the spread of the
            groups' losses you consider meaningful).
        momentum: momentum of the controller's velocity (published 0.9).
        meta_lr: how far the base LR moves per unit of velocity (published 0.5).
        permute: give the groups a fresh random permutation of the multipliers after each vote.
        blend: merge target: ``"mean"`` (published), ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "softmax"
    temperature: float = 0.1
    momentum: float = 0.9
    meta_lr: float = 0.5
    permute: bool = True
    blend: str = "mean"
    velocity: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    shape: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive("temperature", self.temperature)
        check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_number("meta_lr", self.meta_lr, low=0.0)
        check_bool("permute", self.permute)
        check_choice("blend", self.blend, BLENDS)

    def explore(self, ballot: Ballot, generator: torch.Generator) -> VoteResult:
        key, losses, multipliers, healthy = ballot.key, ballot.losses, ballot.multipliers, ballot.healthy
        if len(self.shape.get(key, ())) != len(multipliers):  # first vote, or resumed with another group count
            mean_m = sum(multipliers) / len(multipliers)
            self.shape[key] = [m / mean_m for m in multipliers]
        weights = softmax_weights(losses, healthy, self.temperature)
        winner = winner_of(losses, healthy)
        if not ballot.move or winner < 0 or ballot.schedule_lr <= 0:
            return VoteResult(weights, winner, list(multipliers))
        idx = [g for g, ok in enumerate(healthy) if ok]
        schedule_lr = ballot.schedule_lr
        lrs = [schedule_lr * m for m in multipliers]
        mean_lr = sum(lrs[g] for g in idx) / len(idx)
        delta = sum(weights[g] * lrs[g] for g in idx) - mean_lr
        v = self.momentum * self.velocity.get(key, 0.0) + (1 - self.momentum) * delta
        self.velocity[key] = v
        base = sum(lrs) / len(lrs)
        new_base = base + self.meta_lr * v
        if not math.isfinite(new_base):
            new_base = base
        new_base = min(max(new_base, base / MAX_BASE_LR_CHANGE), base * MAX_BASE_LR_CHANGE)
        shape = self.shape[key]
        order = torch.randperm(len(shape), generator=generator).tolist() if self.permute else range(len(shape))
        scale = new_base / schedule_lr
        return VoteResult(weights, winner, [scale * shape[i] for i in order])

    def state_dict(self) -> dict:
        return {"velocity": dict(self.velocity), "shape": {k: list(v) for k, v in self.shape.items()}}

    def load_state_dict(self, state: dict) -> None:
        refill(self.velocity, {int(k): float(v) for k, v in state.get("velocity", {}).items()})
        refill(self.shape, {int(k): list(v) for k, v in state.get("shape", {}).items()})


@dataclass(frozen=True)
class Best(Vote):
    """The lowest-loss group wins; every other group is re-centred on the winner's multiplier; every group then
    blends toward ``blend``.

    The others get ``m_winner * exp(spread * u_g)`` where ``u`` are evenly spaced positions around the winner's
    (which keeps its own multiplier). The log-spread starts at half the log-range of the initial multipliers and
    shrinks by ``shrink`` each vote down to ``min_spread`` (never zero: variation is kept).

    Args:
        shrink: factor by which the log-spread of multipliers narrows each vote, in (0, 1].
        min_spread: floor of that log-spread (> 0: variation is never lost).
        blend: merge target: ``"mean"``, ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "best"
    shrink: float = 0.5
    min_spread: float = 0.05
    blend: str = "mean"
    spread: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_number("shrink", self.shrink, 0.0, 1.0, low_open=True)
        check_positive("min_spread", self.min_spread)
        check_choice("blend", self.blend, BLENDS)

    def explore(self, ballot: Ballot, generator: torch.Generator) -> VoteResult:
        key, losses, multipliers, healthy = ballot.key, ballot.losses, ballot.multipliers, ballot.healthy
        winner = winner_of(losses, healthy)
        weights = [1.0 if g == winner else 0.0 for g in range(len(losses))]
        if key not in self.spread:
            half_range = (math.log(max(multipliers)) - math.log(min(multipliers))) / 2
            self.spread[key] = max(half_range, self.min_spread)
        if not ballot.move or winner < 0:
            return VoteResult(weights, winner, list(multipliers))
        spread = max(self.spread[key] * self.shrink, self.min_spread)
        self.spread[key] = spread
        n = len(multipliers)
        positions = symmetric_positions(n)
        center = min(range(n), key=lambda k: (abs(positions[k]), k))
        offsets = [p - positions[center] for k, p in enumerate(positions) if k != center]
        order = torch.randperm(n - 1, generator=generator).tolist()
        others = [g for g in range(n) if g != winner]
        new = list(multipliers)
        for g, k in zip(others, order):
            new[g] = multipliers[winner] * math.exp(spread * offsets[k])
        return VoteResult(weights, winner, new)

    def state_dict(self) -> dict:
        return {"spread": dict(self.spread)}

    def load_state_dict(self, state: dict) -> None:
        refill(self.spread, {int(k): float(v) for k, v in state.get("spread", {}).items()})



def divergent(losses: Sequence[float], healthy: Sequence[bool], factor: Optional[float]) -> list[bool]:
    """Which groups count as diverged: non-finite loss, already unhealthy, or loss > factor x best (positive)."""
    out = [not ok or not math.isfinite(loss) for loss, ok in zip(losses, healthy)]
    finite = [loss for loss, bad in zip(losses, out) if not bad]
    if factor is not None and finite and min(finite) > 0:
        best = min(finite)
        out = [bad or loss > factor * best for loss, bad in zip(losses, out)]
    return out
