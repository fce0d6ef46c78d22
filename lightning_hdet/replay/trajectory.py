"""The learning-rate trajectory an HDET run found, and optimizer hooks that replay it (pure: torch only).

An HDET run's vote history has one row per vote and group: the vote's ``step``, the ``group``, the real learning
rate ``lr`` the group trains with from that vote on (of its first param group: multiplier x the schedule's LR at
the vote) and the vote's ``winner``. The *winning trajectory* is, for each vote interval, the learning rate of the
group that won the vote at its end (the interval's best LR; its parameters are what the merge carries on):

* interval 0 (steps ``0 .. v_1 - 1``): the winner of vote ``v_1`` at its initial multiplier (the strategy's
  ``lr_multipliers`` when training started, recorded in the run config as ``hdet/lr_multipliers``);
* interval k (steps ``v_k .. v_{k+1} - 1``): the winner of vote ``v_{k+1}`` at the LR vote ``v_k`` gave it;
* after the last vote: its winner at the LR it gave it (what HDET would have continued with).

Multipliers, not absolute LRs, are replayed, on top of whatever the optimizer and schedulers say, exactly as HDET
applied them: an interval's multiplier is its recorded LR over the schedule's LR at the interval's first step,
which the replaying run's own (identical) schedule says there. With one param group and the same schedule the
replayed LR equals the winner's, step by step. A param group beyond the first gets the first one's multiplier; a
rolled-back interval is replayed at its winner's LR (a plain run cannot undo steps).

A run that explored other hyperparameters (``HDETStrategy(explore=...)``) is replayed the same way for each of them:
the winner's value (a vote-history column per name) over what the replaying optimizer says at the piece's first
step (through ``1 - beta`` for a momentum, :mod:`~lightning_hdet.hdet.hyperparams`), interval 0 at the winner's
initial multiplier (``hdet/explore/<name>`` in the run config).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Optional

from torch.optim import Optimizer

from lightning_hdet._checks import KnownArguments
from lightning_hdet.hdet.hyperparams import ONE_MINUS, base, scaled
from lightning_hdet.hdet.multipliers import scaled_lr
from lightning_hdet.replay.sources import Initial, Source, load_run
from lightning_hdet.records.wandb import TRAINED, VOTE_COLUMNS


@dataclass(frozen=True)
class Piece:
    """One stretch of the trajectory: from optimizer step ``start`` on, the LR ``group`` trained with."""

    start: int  # 0-based index of the piece's first optimizer step
    group: int  # the group whose LR is replayed
    multiplier: Optional[float]  # known multiplier (interval 0), or None: ``lr`` over the schedule at ``start``
    lr: Optional[float]  # the real LR the vote at ``start`` gave the group (None for interval 0)
    # the other explored hyperparameters: their known multipliers (interval 0), else the values the vote gave
    explored: dict[str, float] = field(default_factory=dict)


class LRTrajectory(KnownArguments):
    """The winning LR trajectory of an HDET run, as pieces (see the module docstring)."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        if not pieces or pieces[0].start != 0 or any(b.start <= a.start for a, b in zip(pieces, pieces[1:])):
            raise ValueError(f"`pieces` must start at step 0 and increase, got {[p.start for p in pieces]}.")
        self.pieces = list(pieces)
        self._starts = [p.start for p in self.pieces]

    @classmethod
    def from_votes(cls, rows: Iterable[Mapping[str, Any]], initial_multipliers: Sequence[float],
                   initial_explored: Optional[Mapping[str, Sequence[float]]] = None) -> LRTrajectory:
        """Build it from vote-history rows (``step``, ``group``, ``lr``, ``winner``, and a value per other explored
        hyperparameter) and every group's multiplier when training started (the LR's; ``initial_explored``: the
        others', by name)."""
        votes: dict[int, dict[str, Any]] = {}
        for row in rows:
            vote = votes.setdefault(int(row["step"]), {"winner": int(row["winner"]), "lrs": {}, "explored": {}})
            vote["lrs"][int(row["group"])] = float(row["lr"])
            vote["explored"][int(row["group"])] = _explored_of(row)
        if not votes:
            raise ValueError("The vote history has no rows: the run voted no time, so there is nothing to replay.")
        steps = sorted(votes)
        initial = [float(m) for m in initial_multipliers]
        groups = max(max(v["lrs"]) for v in votes.values()) + 1
        if len(initial) != groups:
            raise ValueError(f"`initial_multipliers` has {len(initial)} values, but the vote history has {groups} "
                             "groups; give the strategy's multipliers when training started (one per group).")
        first = votes[steps[0]]["winner"]
        pieces = [Piece(0, first, initial[first], None, _initial_explored(votes[steps[0]], initial_explored, first))]
        for step, following in zip(steps, steps[1:] + [None]):
            winner = votes[step if following is None else following]["winner"]
            if winner < 0:
                winner = votes[step]["winner"]  # nobody healthy at the next vote: stay with this vote's winner
            pieces.append(Piece(step, winner, None, votes[step]["lrs"][winner], votes[step]["explored"][winner]))
        return cls(pieces)

    @classmethod
    def from_run(cls, source: Source, initial_multipliers: Optional[Initial] = None) -> LRTrajectory:
        """Build it from a finished run: its log dir, ``vote_history.csv``, checkpoint or vote rows (see
        :func:`~lightning_hdet.replay.sources.load_run`)."""
        return cls.from_votes(*load_run(source, initial_multipliers))

    def piece_index(self, step: int) -> int:
        """Index of the piece that holds optimizer step ``step`` (0-based)."""
        return max(bisect_right(self._starts, step) - 1, 0)


class ReplayHooks:
    """Replay an :class:`LRTrajectory` on one optimizer: a step pre-hook scales every param group's ``lr`` by the
    piece's multiplier, the post-hook restores it (so schedulers never see it), and counts the step.

    Args:
        trajectory: what to replay.
        step: the optimizer steps already taken (a resumed run's ``global_step``).
        multipliers: multipliers already computed, by piece index (a resumed run's :meth:`state_dict`).
        explored: the same for the other explored hyperparameters, by piece index and name.
    """

    def __init__(self, trajectory: LRTrajectory, step: int = 0, multipliers: Optional[Mapping[int, float]] = None,
                 explored: Optional[Mapping[int, Mapping[str, float]]] = None):
        self.trajectory, self.step = trajectory, step
        self.multipliers: dict[int, float] = {int(k): float(v) for k, v in (multipliers or {}).items()}
        self.explored: dict[int, dict[str, float]] = {int(k): dict(v) for k, v in (explored or {}).items()}
        self._handles: list[Any] = []
        self._scaled: Optional[AbstractContextManager[None]] = None

    def attach(self, optimizer: Optimizer) -> ReplayHooks:
        self._handles += [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def multiplier(self, optimizer: Optimizer) -> float:
        """The multiplier of the current step (computed at its piece's first step, from the schedule's LR there)."""
        index = self.trajectory.piece_index(self.step)
        piece = self.trajectory.pieces[index]
        if index not in self.multipliers:
            if piece.multiplier is not None:
                self.multipliers[index] = piece.multiplier
            else:
                schedule = float(optimizer.param_groups[0]["lr"])
                if schedule <= 0:
                    raise ValueError(f"HDET replay: the schedule's LR at step {self.step} is {schedule}; the replayed "
                                     "LR is a multiple of it, so the schedule must match the HDET run's.")
                self.multipliers[index] = piece.lr / schedule
        return self.multipliers[index]

    def explored_multipliers(self, optimizer: Optimizer) -> dict[str, float]:
        """The other explored hyperparameters' multipliers of the current step (fixed at its piece's first step)."""
        index = self.trajectory.piece_index(self.step)
        piece = self.trajectory.pieces[index]
        if index not in self.explored:
            known = piece.multiplier is not None  # interval 0: the initial multipliers themselves
            self.explored[index] = dict(piece.explored) if known else {
                name: _multiplier(name, value, optimizer, self.step) for name, value in piece.explored.items()}
        return self.explored[index]

    def _before(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        m, explored = self.multiplier(optimizer), self.explored_multipliers(optimizer)
        width = len(optimizer.param_groups)
        stack = ExitStack()
        stack.enter_context(scaled_lr(optimizer, [m] * width))
        if explored:
            stack.enter_context(scaled(optimizer, {n: [v] * width for n, v in explored.items()}))
        self._scaled = stack

    def _after(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._scaled is not None:
            self._scaled.__exit__(None, None, None)
            self._scaled = None
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "multipliers": dict(self.multipliers), "explored": dict(self.explored)}


# The controller's row keys that are no hyperparameter (a checkpoint's or ``callback.history``'s rows hold them).
_BOOKKEEPING = ("reason", "edge", "clear")


def _explored_of(row: Mapping[str, Any]) -> dict[str, float]:
    """A vote row's other explored hyperparameters: the callback's ``explored`` entry, or a CSV row's extra columns
    (not ``trained_lr`` nor ``trained_<name>``: what the group trained at before the vote, not what the vote set)."""
    if isinstance(row.get("explored"), Mapping):
        return {n: float(v) for n, v in row["explored"].items()}
    return {k: float(v) for k, v in row.items() if k not in VOTE_COLUMNS and k not in _BOOKKEEPING
            and not k.startswith(TRAINED) and v not in (None, "")}


def _initial_explored(vote: Mapping[str, Any], initial: Optional[Mapping[str, Sequence[float]]], winner: int
                      ) -> dict[str, float]:
    """Interval 0's winner's initial multiplier of every name the vote history holds."""
    names = sorted(set().union(*(v.keys() for v in vote["explored"].values())))
    missing = [n for n in names if n not in (initial or {})]
    if missing:
        raise ValueError(f"The vote history explored {missing} besides the LR, but `initial_multipliers` holds no "
                         f"initial multipliers for them; pass {{'lr': [...], {missing[0]!r}: [...]}} (the run config's "
                         f"'hdet/explore/{missing[0]}'), one per group.")
    return {n: float(initial[n][winner]) for n in names}  # type: ignore[index]


def _multiplier(name: str, value: float, optimizer: Optimizer, step: int) -> float:
    """The multiplier that turns what ``optimizer`` says into ``value`` (the winner's)."""
    quantity = base(optimizer.param_groups[0], name)
    if quantity <= 0:
        raise ValueError(f"HDET replay: the optimizer's {name} at step {step} gives {quantity} to multiply; the "
                         f"replayed {name} is a multiple of it, so the optimizer must match the HDET run's.")
    return ((1.0 - value) if name in ONE_MINUS else value) / quantity
