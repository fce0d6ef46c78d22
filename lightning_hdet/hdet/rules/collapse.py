"""Collapse detection for HDET's safety net (pure: no Lightning, no process groups).

A run can fail without a NaN: AdamW at a too-high learning rate saturates at the loss of a constant predictor
and stays there. Every group then looks equally bad, so comparing groups with each other ("10x worse than the
best") never fires. These rules also judge each group against its *own* history:

* ``non-finite``: the loss is NaN or infinite (or the group already skipped a step this interval);
* ``x best``: the loss exceeds ``divergence_factor`` times the best group's (positive losses; the rule before this module);
* ``stalled``: ``stall_patience`` votes in a row at or above ``(1 - stall_tolerance)`` times the group's starting level
  (the loss of the untrained model at the first training step) plus ``NOISE_Z`` standard errors of that level,
  *after its loss has left that level's noise band once* (fell below it, or was knocked above it): it has made no
  progress since. A plateau at the untrained loss, where nothing has happened yet, is not counted: by its loss
  alone it cannot be told from a collapse back to exactly that level, and rolling back and cutting every LR on a
  plateau only lengthens it (``chance_loss`` catches a group that sits at the constant predictor's level);
* ``rose``: the loss, less ``NOISE_Z`` standard errors of the interval's mean, exceeds ``(1 + rise_margin)`` times the
  group's own previous interval;
* ``relapsed``: every group at once is back at its starting level (within ``LEVEL_TOLERANCE``) although the
  ensemble's previous intervals were clearly below it (``RELAPSE_DEPTH``; needs ``rise_margin``): a classifier that
  collapses falls back to about the untrained loss, never twice a trained interval's, so the doubling alone would
  wait for the ``stalled`` rule's patience while every group trained on from the collapsed model (a CNN with SGD:
  issue 59);
* ``chance``: the loss is at or above ``(1 - chance_tolerance) * chance_loss``, the loss of a constant predictor
  (e.g. ``ln(num_classes)``; for a language model the unigram entropy is the tighter choice).

**Noise.** The progress rules compare numbers measured on a few batches. A single first step's loss is one batch:
an easy batch makes a low starting level that a healthy group's later intervals sit above, and a short interval
of small batches can double by chance. So both rules ask for the difference to exceed the noise: the starting
level is the mean of the first step's loss over *every* rank (all groups start from the same model, so every
rank's first batch measures the same thing) with its standard error over the ranks, and an interval's standard
error comes from the spread of its curve's bins (:func:`~lightning_hdet.hdet.rules.signals.curve_error`). Where the
noise is small (large batches, e.g. a collapse at the constant predictor's level) the rules are as before.

The progress rules (``stalled``, ``rose``) can be switched off for a vote (``progress=False``), e.g. during a
learning-rate warm-up, when no progress is expected yet.

:class:`CollapseHistory` is the small per-group state these rules need; :func:`judge` reads it and the options of
:class:`~lightning_hdet.hdet.rules.safety_net.SafetyNet` (``SafetyNet.judge``) and returns a :class:`Verdict`; :func:`advance` returns the history after the vote. A merge may become the roll-back point only
if :func:`is_good`: every group that counts has improved on its starting level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from lightning_hdet.hdet.rules.safety_net import SafetyNet

NAN = math.nan
NOISE_Z = 2.0  # standard errors a difference must exceed before the progress rules believe it (about 95 %)
# How far below its starting level's band the ensemble's lowest previous interval must have been for a return of
# every group to that level to count as a relapse ("relapsed"): 10 % of the level, well beyond a few batches' wobble
# on an early plateau, where a false alarm would roll a slow start back (what the stall rule's design avoids;
# tests/test_plateau.py's blip from 6 % below stays noise).
RELAPSE_DEPTH = 0.10
# The least a loss must move from its starting level, relative to it, to count as having left it (the rules that ask
# whether a group has moved at all: `_left_start`, `rose_above_start`, `none_progressed`). A classifier's untrained
# loss is about the same on every item, so the first step's standard error is tiny, while the validation loss the
# votes read (`monitor`) of a model that has not learned yet sits up to 1.5 % off the first training batch's (other
# items; a few steps that moved only the output bias: a CNN with SGD 10-40x too low, issue 59). That offset armed the
# stall and plateau rules on ensembles that had not learned yet, which then cut every LR 20-100x.
LEVEL_TOLERANCE = 0.02


@dataclass
class CollapseHistory:
    """Per group: the starting level and its standard error, the previous interval's loss and the votes in a row
    without progress."""

    start: list[float] = field(default_factory=list)
    previous: list[float] = field(default_factory=list)
    stalled: list[int] = field(default_factory=list)
    start_error: list[float] = field(default_factory=list)
    left: list[bool] = field(default_factory=list)  # the group's loss has left its starting level at some vote

    def sized(self, num_groups: int) -> "CollapseHistory":
        """This history, or a fresh one if it was kept for another number of groups (e.g. a re-sharded resume)."""
        if len(self.start) == num_groups:
            if len(self.start_error) != num_groups or len(self.left) != num_groups:  # an older history
                return CollapseHistory(self.start, self.previous, self.stalled, [0.0] * num_groups,
                                       [True] * num_groups)  # judged as before the noise rules
            return self
        return CollapseHistory([NAN] * num_groups, [NAN] * num_groups, [0] * num_groups, [0.0] * num_groups,
                               [False] * num_groups)

    def band(self, g: int) -> tuple[float, float]:
        """Group ``g``'s starting level less and plus ``NOISE_Z`` standard errors (NaN where the level is unknown)."""
        half = NOISE_Z * self.start_error[g]
        return self.start[g] - half, self.start[g] + half

    def level_band(self, g: int) -> tuple[float, float]:
        """:meth:`band`, at least ``LEVEL_TOLERANCE`` of the level either side: inside it a loss has not moved."""
        low, high = self.band(g)
        half = LEVEL_TOLERANCE * abs(self.start[g])
        return min(low, self.start[g] - half), max(high, self.start[g] + half)

    def state_dict(self) -> dict:
        return {"start": list(self.start), "previous": list(self.previous), "stalled": list(self.stalled),
                "start_error": list(self.start_error), "left": list(self.left)}

    def load_state_dict(self, state: dict) -> None:
        self.start = [float(v) for v in state.get("start", [])]
        self.previous = [float(v) for v in state.get("previous", [])]
        self.stalled = [int(v) for v in state.get("stalled", [])]
        self.start_error = [float(v) for v in state.get("start_error", [])]
        self.left = [bool(v) for v in state.get("left", [])]


@dataclass
class Verdict:
    """The outcome of one vote's check: who diverged and why (``""``: fine), and the updated stall counters."""

    diverged: list[bool]
    reasons: list[str]
    stalled: list[int]

    @property
    def all_diverged(self) -> bool:
        return bool(self.diverged) and all(self.diverged)


def _left_start(history: CollapseHistory, g: int, loss: float) -> bool:
    """Whether group ``g``'s loss has left its starting level's band (:meth:`CollapseHistory.level_band`), now or at
    an earlier vote."""
    low, high = history.level_band(g)
    now = math.isfinite(history.start[g]) and math.isfinite(loss) and not low <= loss <= high
    return history.left[g] or now


def _all_relapsed(history: CollapseHistory, losses: Sequence[float], errors: Sequence[float],
                  bad: Sequence[bool]) -> bool:
    """Whether every group is back at its untrained level (this interval's lower bound inside or above its
    :meth:`CollapseHistory.level_band`) after the ensemble had learned: every group has a previous interval and the
    lowest of them was ``RELAPSE_DEPTH`` below its band's lower edge (positive levels). The whole ensemble fell back
    to its untrained loss, as a classifier does that collapses after every group took the winner's model. A single
    group's relapse is left to the other rules (rescuing it at once cost more than it saved from 40x too high:
    research log, issue 59). Why the ensemble's lowest previous interval and the level band, not each group's
    previous interval and the band's lower edge: the groups share their models at every vote, so one learned model
    is the ensemble's; and a collapsed CNN's validation loss sits within 1 % of ln(6) either side, below an edge two
    tiny standard errors under the first batch's, so collapses at 1.77-1.80 were missed (research log 2026-12-07)."""
    deepest = math.inf
    for g, loss in enumerate(losses):
        edge, previous = history.band(g)[0], history.previous[g]
        if bad[g] or not (math.isfinite(edge) and edge > 0 and math.isfinite(previous)):
            return False
        if loss - NOISE_Z * errors[g] < history.level_band(g)[0]:
            return False
        deepest = min(deepest, previous / edge)
    return bool(losses) and deepest < 1 - RELAPSE_DEPTH


def _worse_than_best(losses: Sequence[float], bad: Sequence[bool], factor: Optional[float]) -> list[bool]:
    finite = [loss for loss, b in zip(losses, bad) if not b]
    if factor is None or not finite or min(finite) <= 0:
        return [False] * len(losses)
    return [loss > factor * min(finite) for loss in losses]


def judge(
    rule: SafetyNet,
    history: CollapseHistory,
    losses: Sequence[float],
    healthy: Sequence[bool],
    progress: bool = True,
    errors: Optional[Sequence[float]] = None,
) -> Verdict:
    """Which groups count as diverged at this vote, and why (the first reason that applies).

    ``errors``: each group's standard error of this interval's loss (None: no margin for the ``rose`` rule).
    """
    history = history.sized(len(losses))
    floor = 1 - rule.stall_tolerance
    bad = [not ok or not math.isfinite(loss) for loss, ok in zip(losses, healthy)]
    worse = _worse_than_best(losses, bad, rule.divergence_factor)
    errors = [e if math.isfinite(e) else 0.0 for e in errors] if errors is not None else [0.0] * len(losses)
    reasons, stalled = [], []
    relapsed = progress and rule.rise_margin is not None and _all_relapsed(history, losses, errors, bad)
    for g, loss in enumerate(losses):
        start = history.band(g)[1]  # the starting level's upper bound
        previous, low = history.previous[g], loss - NOISE_Z * errors[g]  # this interval's lower bound
        at_start = (progress and not bad[g] and math.isfinite(start) and loss >= floor * start
                    and _left_start(history, g, loss))
        rose = (progress and rule.rise_margin is not None and math.isfinite(previous)
                and low > (1 + rule.rise_margin) * previous)
        stalled.append(history.stalled[g] + 1 if at_start else 0)
        if bad[g]:
            reasons.append("non-finite")
        elif worse[g]:
            reasons.append("x best")
        elif relapsed:
            reasons.append("relapsed")
        elif rule.stall_patience is not None and stalled[g] >= rule.stall_patience:
            reasons.append("stalled")
        elif rose:
            reasons.append("rose")
        elif rule.chance_loss is not None and loss >= (1 - rule.chance_tolerance) * rule.chance_loss:
            reasons.append("chance")
        else:
            reasons.append("")
    return Verdict([r != "" for r in reasons], reasons, stalled)


def advance(
    history: CollapseHistory,
    verdict: Verdict,
    losses: Sequence[float],
    rolled_back: bool,
    first: Optional[Sequence[float]] = None,
    first_error: Optional[Sequence[float]] = None,
) -> CollapseHistory:
    """The history after a vote.

    A group's starting level is set once, from ``first`` (each group's loss at its first training step; ``None``
    where no interval held that step: the ``stalled`` rule stays off), with its standard error
    ``first_error`` (None: no margin). A diverged group (it restarts from the healthy groups' model) and every
    group after a roll-back forget their previous interval and their stall count.
    """
    history = history.sized(len(losses))
    first = list(first) if first is not None else [NAN] * len(losses)
    first_error = list(first_error) if first_error is not None else [0.0] * len(losses)
    fresh = [not math.isfinite(s) and math.isfinite(f) for s, f in zip(history.start, first)]
    start = [f if new else s for new, s, f in zip(fresh, history.start, first)]
    error = [e if new else old for new, old, e in zip(fresh, history.start_error, first_error)]
    reset = [rolled_back or bad for bad in verdict.diverged]
    previous = [NAN if r else x for r, x in zip(reset, losses)]
    stalled = [0 if r else s for r, s in zip(reset, verdict.stalled)]
    known = CollapseHistory(start, previous, stalled, error, list(history.left))  # with a start set this vote
    left = [not r and _left_start(known, g, x) for g, (r, x) in enumerate(zip(reset, losses))]
    return CollapseHistory(start, previous, stalled, error, left)


def restarted(history: CollapseHistory, groups: Optional[Sequence[bool]] = None) -> CollapseHistory:
    """The history after every group (or those flagged in ``groups``) restarted from the initial model
    (``Search.restart_below``, a probe below a too-high grid): the starting levels stand (the same model), their
    previous intervals, stall counts and departures from the start are forgotten, so the climb back to the starting
    level does not read as a rise."""
    n = len(history.start)
    fresh = [True] * n if groups is None else list(groups)
    return CollapseHistory(list(history.start), [NAN if f else x for f, x in zip(fresh, history.previous)],
                           [0 if f else x for f, x in zip(fresh, history.stalled)], list(history.start_error),
                           [False if f else x for f, x in zip(fresh, history.left)])


def rose_above_start(history: CollapseHistory, losses: Sequence[float]) -> bool:
    """Whether some group's loss is above its starting level's band (:func:`risen`)."""
    return any(risen(history, losses))


def risen(history: CollapseHistory, losses: Sequence[float]) -> list[bool]:
    """Which groups' losses are above their starting level's band (:meth:`CollapseHistory.level_band`: a blow-up,
    or a collapse knocked above the untrained level; an infinite or NaN loss counts; a group whose level is unknown
    does not)."""
    known = [g < len(history.start) and g < len(history.start_error) and math.isfinite(history.start[g])
             for g in range(len(losses))]
    return [k and not loss <= history.level_band(g)[1] for g, (k, loss) in enumerate(zip(known, losses))]


def none_progressed(history: CollapseHistory, losses: Sequence[float], healthy: Sequence[bool]) -> bool:
    """Whether no healthy group's loss is below its starting level's band (:meth:`CollapseHistory.level_band`): no LR
    tried has taught the model anything yet. False where no group is healthy or a healthy group's level is unknown
    (it cannot be said)."""
    history = history.sized(len(losses))
    kept = [g for g, ok in enumerate(healthy) if ok]
    for g in kept:
        low = history.level_band(g)[0]
        if not (math.isfinite(low) and losses[g] >= low):
            return False
    return bool(kept)


def has_progressed(history: CollapseHistory, group: int, loss: float) -> bool:
    """Whether ``loss`` is below group ``group``'s starting level less ``NOISE_Z`` standard errors (True where that
    level is unknown)."""
    if group >= len(history.start) or group >= len(history.start_error):
        return True
    start = history.band(group)[0]
    return not math.isfinite(start) or loss < start


def is_good(rule: SafetyNet, verdict: Verdict, losses: Sequence[float], history: CollapseHistory) -> bool:
    """Whether this vote's merged model may become the roll-back point.

    Only when every group that counts (did not diverge; diverged groups add nothing to the merge) is below its
    starting level, less the stall tolerance, where that level is known: a model merged from groups that have not improved yet, or are sliding
    into a collapse, is not a safe place to return to.
    """
    history = history.sized(len(losses))
    kept = [(x, s) for x, s, bad in zip(losses, history.start, verdict.diverged) if not bad]
    floor = 1 - rule.stall_tolerance
    return bool(kept) and all(not math.isfinite(s) or x < floor * s for x, s in kept)
