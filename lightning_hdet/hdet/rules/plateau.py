"""A plateau that is not learning is a failure (pure: no Lightning, no process groups).

AdamW far above its good learning rate (100-300x) saturates within a few steps at the loss of a constant
predictor (the label prior) and stays there: no NaN, no rise, every group equally bad. The rules of
:mod:`~lightning_hdet.hdet.rules.collapse` deliberately leave a plateau alone (``stalled`` needs the loss back at the
untrained model's level, ``chance`` needs the user's ``chance_loss``; the prior's loss is often well below the
untrained model's), so the run sits there to the end. This rule closes that hole with the loss alone, the way
``ReduceLROnPlateau`` does, on the whole ensemble's evidence:

* the ensemble **improves** at a vote when its best group's interval loss is below the best so far by more than
  ``NOISE_Z`` standard errors of that interval and a relative ``min_gain``; otherwise it is **stuck** for the
  interval's steps (one ensemble-wide level: a group's own best so far ratchets down on noise alone, measured);
* when the ensemble is stuck for ``steps`` optimizer steps in a row (in a run of known length, a fifth of it where
  that is shorter, but at least two votes; doubled after each ladder; never with fewer steps than that left in the
  run: :func:`patience`, :func:`judged_at`; a rescue's roll-back keeps counting: :func:`forget`), every group
  counts as failed: the ensemble
  **rolls back** and restarts on a geometric ladder of learning rates ``cut`` to ``cut**2`` times the current
  geometric mean, a search downward (ten to a hundred times lower for ``cut=0.1``); a ladder still stuck twice
  as long descends again. (A single group stuck beside better ones needs no rule of its own: the vote
  moves it, e.g. PBT copies a top group into the bottom quantile.)

**Where the ladder starts.** A collapse at a too-high LR is often not reversible in place (AdamW at 300x the good
LR kills every ReLU of an MLP within 50 steps, measured: no lower LR revives them), and its first intervals look
like progress (a blow-up, then the label prior's loss, below the untrained model's), so the last good merge may be
the collapsed model. A converged run is flat too, and its model must not be lost. So the ladder's upper half
(rounded down) rolls back to the last good merged model and its lower half to the **initial model** (held by the
strategy from the start of a fresh fit; without one, e.g. after a resume, the last good merge): the votes that
follow pick whichever learns, and copy it over the others.

A run that learns never fires it: an ensemble whose best group keeps setting new bests is never stuck; only one
in which no group improved for ``steps`` steps is touched (where a lower learning rate is what
``ReduceLROnPlateau`` would pick too, and the ladder's upper half keeps the model).

**Only after a failure.** A run in which the safety net has not yet caught any group (no blow-up, no collapse, no
earlier ladder: ``armed=False``) is never stuck, however flat: a CNN at a good LR can sit at the untrained level for
a third of a short run before it learns, an ensemble at too low an LR sits there longer, and a run that learned
fast can go flat for two votes on noise; a 10-100x lower LR is wrong for all three. Each of them fired the rule in
benchmark 2 (128 steps, its 2-votes-in-the-search default) and ended at 1.1-1.3x the untuned run, while every
collapse the rule exists for (the crash table, 100-300x too high) had a group caught before it went flat
(research log 2026-12-03). On votes that read a validation metric (``monitor``), a run that **memorises** counts as
failed too (:func:`memorising`): its ensemble's lowest loss rose at ``MEMORISING_RISES`` votes in a row, every LR
fitting the training data at the held-out data's cost. Nothing else arms the rule there (no group blows up), and
the ladder's roll-back to the last good merge is what stops it (the MLP read 37 times from 10x too high, at 8
processes: 1.24 -> 1.04x the grid's best; research log 2026-12-07).

:class:`PlateauHistory` is the state (the best level, steps stuck); :func:`judge_plateau` returns a
:class:`PlateauVerdict`; :func:`ladder` is the all-stuck ensemble's new multiplier table, :func:`from_initial`
which of its groups restart from the initial model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_int, check_number
from lightning_hdet.hdet.rules.collapse import NOISE_Z, Verdict


@dataclass(frozen=True)
class PlateauRule(KnownArguments):
    """``steps``: the most optimizer steps the ensemble may go without a new best before every group fails (a run
    of known length waits a fifth of it where that is shorter, at least two votes; twice as long after each ladder;
    ``None`` switches the rule off); ``cut``: the ladder's top rung relative to the current LRs, in (0, 1) (its
    bottom rung is ``cut ** 2``); ``min_gain``: the relative improvement on the best so far that counts as a new
    best."""

    steps: Optional[int] = 200
    cut: float = 0.1
    min_gain: float = 0.01

    def __post_init__(self) -> None:
        check_int("PlateauRule.steps", self.steps, minimum=1, optional=True,
                  hint="Optimizer steps a group may go without improving; None switches the rule off.")
        check_number("PlateauRule.cut", self.cut, 0.0, 1.0, low_open=True, high_open=True,
                     hint="An all-stuck ensemble moves to cut..cut**2 times its learning rates, e.g. 0.1.")
        check_number("PlateauRule.min_gain", self.min_gain, 0.0, 1.0, high_open=True,
                     hint="A relative improvement on the best loss so far, e.g. 0.01.")


#: Votes in a row at which the ensemble's lowest loss rose that make a run on a validation metric memorising.
MEMORISING_RISES = 2


@dataclass
class PlateauHistory:
    """The ensemble's best interval loss so far, the optimizer steps since it, the step of the last vote, the last
    judged vote's lowest loss and the judged votes in a row at which it rose."""

    best: float = math.nan
    stuck_steps: int = 0
    last_step: int = 0
    low: float = math.nan
    rises: int = 0

    def state_dict(self) -> dict:
        state = {"best": self.best, "stuck_steps": self.stuck_steps, "last_step": self.last_step}
        # the memorising count only once a vote was judged: an older checkpoint round-trips as it was
        return state if math.isnan(self.low) else {**state, "low": self.low, "rises": self.rises}

    def load_state_dict(self, state: dict) -> None:
        self.best = float(state.get("best", math.nan))
        self.stuck_steps = int(state.get("stuck_steps", 0))
        self.last_step = int(state.get("last_step", 0))
        self.low = float(state.get("low", math.nan))  # (older checkpoints: no rise seen yet)
        self.rises = int(state.get("rises", 0))


@dataclass(frozen=True)
class PlateauVerdict:
    """Whether the ensemble is stuck long enough (every group fails: the ladder), and the history after the vote."""

    all_stuck: bool
    history: PlateauHistory

    def applied(self, verdict: Verdict) -> Verdict:
        """``verdict`` with every group failed (reason ``"plateau"`` where no other rule caught it) if all stuck."""
        if not self.all_stuck:
            return verdict
        reasons = [r or "plateau" for r in verdict.reasons]
        return Verdict([True] * len(reasons), reasons, verdict.stalled)


def patience(rule: PlateauRule, run_steps: Optional[int], every: int, cuts: int = 0) -> Optional[int]:
    """The steps the ensemble may go stuck before the next ladder: ``rule.steps``, or in a run of ``run_steps``
    optimizer steps a fifth of it where that is shorter, never under two votes (``every`` steps apart); doubled
    after each of the run's ``cuts`` so far. Why a fifth: a rule that waits 200 steps fires late or never in a
    300-step run, leaving the ladder no steps to learn (the crash table); two votes because one interval without a
    1 % gain is common in a run that learns; doubled because a ladder restarted from the initial model needs time
    to leave the untrained level (at a fixed patience a 20x-high CNN cut its LRs three times, to 1e-7)."""
    if rule.steps is None:
        return None
    steps = rule.steps if run_steps is None else min(rule.steps, max(2 * every, run_steps // 5))
    return steps * 2**cuts


def judged_at(steps: Optional[int], run_steps: Optional[int], step: int) -> Optional[int]:
    """``steps`` where a ladder started at ``step`` would still have ``steps`` left to learn, else ``None`` (the rule
    does not count this vote). Why one patience and not none: a ladder started later only throws the run's end
    away, and a run that flattens near its end is more often at its noise floor than stuck (the insurance test: from
    the right LR a run converged by step 32 of 64 would otherwise have its LR cut 10x at step 48 and end at 5x the
    loss). Why not two (the wait :func:`patience` gives a ladder before judging it again): the ladder's rungs are
    judged against each other by the votes that follow, not by this rule; requiring two patiences left forbade the
    ladder from step 152 of a 300-step run voting every 38 steps, which left tabular and shapes stuck at their
    prior after a rescue at step 152 (research log 2026-12-05)."""
    if steps is None or run_steps is None or run_steps - step >= steps:
        return steps
    return None


def improved(rule: PlateauRule, best: float, loss: float, error: float) -> bool:
    """Whether ``loss`` is a new best: below ``best`` by ``NOISE_Z`` standard errors and ``min_gain`` of it (the
    first finite loss always is)."""
    if not math.isfinite(loss):
        return False
    return not math.isfinite(best) or loss < best - NOISE_Z * error - rule.min_gain * abs(best)


def judge_plateau(
    rule: PlateauRule,
    history: PlateauHistory,
    verdict: Verdict,
    losses: Sequence[float],
    step: int,
    errors: Optional[Sequence[float]] = None,
    progress: bool = True,
    armed: bool = True,
) -> PlateauVerdict:
    """The plateau rule at the vote at ``step`` (see the module's docstring).

    ``verdict`` is the other rules' (a group they caught does not count as the ensemble's best); ``errors``: each
    group's standard error of this interval's loss (None: no margin). ``progress=False`` (warm-up, the final merge)
    judges nothing and does not count the interval; neither does a vote with no healthy group (other rules act).
    ``armed=False`` (nothing has failed in the run yet): the interval is counted, but the ensemble is not stuck.
    """
    g = _lowest(losses, verdict)
    if rule.steps is None or not progress or g is None:
        return PlateauVerdict(False, replace(history, last_step=step))
    low, rises = losses[g], _rises(history, losses[g])
    error = errors[g] if errors is not None and math.isfinite(errors[g]) else 0.0
    if improved(rule, history.best, losses[g], error):
        return PlateauVerdict(False, PlateauHistory(losses[g], 0, step, low, rises))
    stuck_steps = history.stuck_steps + max(step - history.last_step, 0)
    return PlateauVerdict(armed and stuck_steps >= rule.steps,
                          PlateauHistory(history.best, stuck_steps, step, low, rises))


def memorising(history: PlateauHistory, losses: Sequence[float], verdict: Verdict) -> bool:
    """Whether this vote's lowest healthy loss rose above the last judged vote's for the ``MEMORISING_RISES``-th
    vote in a row (see the module docstring; the caller asks only for votes on a validation metric)."""
    g = _lowest(losses, verdict)
    return g is not None and _rises(history, losses[g]) >= MEMORISING_RISES


def _lowest(losses: Sequence[float], verdict: Verdict) -> Optional[int]:
    """The healthy group with the lowest finite loss (the lowest index on a tie), ``None`` without one."""
    healthy = [g for g, (x, bad) in enumerate(zip(losses, verdict.diverged)) if not bad and math.isfinite(x)]
    return min(healthy, key=lambda h: (losses[h], h)) if healthy else None


def _rises(history: PlateauHistory, low: float) -> int:
    """The votes in a row at which the lowest loss rose, this vote's ``low`` included."""
    return history.rises + 1 if math.isfinite(history.low) and low > history.low else 0


def forget(history: PlateauHistory, restarted: bool) -> PlateauHistory:
    """The history after the vote's decision: after a ladder (``restarted``: half of the groups from the initial
    model, at new LRs) the ensemble starts afresh, with a new best level. A rescue's roll-back does not start afresh:
    it restores the last good merge, whose level the best already records, so the climb back to it is not progress
    (it was counted as such, and a collapsed run at the labels' prior never looked stuck: research log 2026-12-05)."""
    return PlateauHistory(math.nan, 0, history.last_step) if restarted else history


def ladder(multipliers: Tensor, cut: float) -> Tensor:
    """The all-stuck ensemble's new ``G x P`` table: per column, rungs ``cut ** (1 + k / (G - 1))`` times the
    column's geometric mean (``k = 0`` the highest), handed out in the order of the current multipliers (the group
    that had the highest LR gets the highest rung). One group gets ``cut`` times its own."""
    table = multipliers.clone().to(torch.float64)
    num_groups = table.shape[0]
    if num_groups == 1:
        return table * cut
    rungs = torch.tensor([cut ** (1 + k / (num_groups - 1)) for k in range(num_groups)], dtype=torch.float64)
    for p in range(table.shape[1]):
        column = multipliers[:, p].to(torch.float64)
        centre = float(column.log().mean().exp())
        order = sorted(range(num_groups), key=lambda g: (-float(column[g]), g))
        for k, g in enumerate(order):
            table[g, p] = centre * rungs[k]
    return table


def from_initial(multipliers: Tensor) -> list[bool]:
    """The groups of a ladder that restart from the initial model: the lower half of its rungs (by the first
    column), rounded down, so one group alone continues from its own model."""
    column = multipliers[:, 0].tolist()
    order = sorted(range(len(column)), key=lambda g: (column[g], -g))  # lowest rung first
    lower = set(order[: len(column) // 2])
    return [g in lower for g in range(len(column))]
