"""The HDET controller: one interval's numbers in, one decision out (pure: no Lightning, no process groups).

:meth:`HDETController.decide` is the whole vote: which groups diverged (the safety net), whether every group must
roll back, the vote weights and winner, the new learning-rate multipliers (the vote rule, then the rescue cuts), and
what the groups merge toward. It owns the vote rule's state and the generator of its random permutations
(:class:`~lightning_hdet.hdet.rules.generator.LazyGenerator`), and checkpoints them through
``state_dict``/``load_state_dict``; the votes' rows and counters are its
:class:`~lightning_hdet.hdet.rules.ledger.VoteLedger`, the search's end its
:class:`~lightning_hdet.hdet.rules.search_end.SearchPhase`. It never touches a model: the callback
hands the :class:`Decision` to the strategy, which executes it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hdet.hdet.hyperparams import Explored, values, vote_explored
from lightning_hdet.hdet.hyperparams import refined as refined_tables
from lightning_hdet.hdet.rules.blends import blend_coefficients, blend_strengths
from lightning_hdet.hdet.rules.collapse import (
    CollapseHistory,
    Verdict,
    advance,
    restarted,
    rose_above_start,
)
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.direction import below_grid, direction, risen_now
from lightning_hdet.hdet.rules.generator import LazyGenerator
from lightning_hdet.hdet.rules.ledger import VoteLedger
from lightning_hdet.hdet.rules.plateau import (
    PlateauHistory,
    PlateauRule,
    PlateauVerdict,
    forget,
    from_initial,
    judge_plateau,
    judged_at,
    patience,
    ladder,
    memorising,
)
from lightning_hdet.hdet.rules.search_end import SearchPhase
from lightning_hdet.hdet.rules.selection import MergeStep, Selection, copy_plan
from lightning_hdet.hdet.rules.signals import curve_error
from lightning_hdet.hdet.rules.votes import Ballot, Vote, divergent, edge_of, winner_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Interval:
    """What one vote interval measured, identical on every rank."""

    step: int  # the optimizer step of the vote
    losses: Sequence[float]  # every group's loss signal (NaN for a group that produced none)
    finite: Sequence[bool]  # every group stayed finite (no skipped optimizer step)
    multipliers: Tensor  # the current multiplier table, ``(num_groups, num_param_groups)``, float64
    schedule_lrs: Sequence[float]  # what the optimizers/schedulers say, one per flattened param group
    shared_gradients: bool  # gradients are averaged over all ranks (``gradient_sync="global"``)
    final: bool = False  # the merge at the end of fit: weigh, merge fully, leave the LRs alone
    curves: Optional[Tensor] = None  # every group's loss curve, ``(num_groups, 2 * bins)`` (signals.LossCurve.row)
    first_losses: Optional[Sequence[float]] = None  # every group's loss at its first training step (fresh runs)
    first_errors: Optional[Sequence[float]] = None  # the standard error of ``first_losses``
    refine: bool = False  # the search ends here (``search_steps``): winner's model, LRs a narrow grid around its LR
    explored: Explored = field(default_factory=Explored)  # the other explored hyperparameters (hyperparams.py)
    holds_initial: bool = True  # the strategy holds the initial model (a fresh run; keeps_initial)


@dataclass(frozen=True)
class Decision:
    """What the strategy executes after one vote, and what the callback logs."""

    step: int
    losses: list[float]
    weights: list[float]  # vote weights of the first param group (one-hot on the winner at a roll-back)
    winner: int  # -1 when no group is healthy
    multipliers: Tensor  # the new multiplier table (rescued groups' rows already cut)
    lrs: list[float]  # every group's new real learning rate of the first param group (for the logs)
    rescued: list[bool]  # groups the safety net caught: they take the target fully and restart their optimizer
    roll_back: bool  # every group returns to the last good merged model instead of merging
    coefficients: list[float] = field(default_factory=list)  # merge target ``sum_g c_g theta_g`` (empty: no merge)
    strengths: list[float] = field(default_factory=list)  # ``theta_g <- (1 - s_g) theta_g + s_g target``
    copies: list[MergeStep] = field(default_factory=list)  # ``vote="pbt"``: copy steps instead of one blend
    keep: bool = True  # the merge target may become the restore point (the safety net judged this vote good)
    reasons: list[str] = field(default_factory=list)  # why each rescued group counts as diverged ("" if not)
    refined: bool = False  # the search ended: every group took the winner's model and restarts its optimizer
    # Groups that restart from the initial model: at a roll-back (the plateau ladder), or every group where the search
    # ended on an LR at most ``Search.restart_below`` times the optimizer's.
    from_initial: list[bool] = field(default_factory=list)
    explored: dict[str, Tensor] = field(default_factory=dict)  # the other explored hyperparameters' new tables
    values: dict[str, list[float]] = field(default_factory=dict)  # their new real values, first param group (logs)
    warning: str = ""  # what the strategy warns about after executing the decision ("": nothing)

    @property
    def restart(self) -> list[bool]:
        """Groups that clear their optimizer state after the merge: the rescued ones, or all when the search ended
        (each group's moments were gathered on another group's parameters)."""
        return [True] * len(self.rescued) if self.refined else list(self.rescued)

    @property
    def plan(self) -> list[MergeStep]:
        """The merge steps to execute in order, one collective each (none at a roll-back)."""
        if self.roll_back:
            return []
        if self.copies:
            return list(self.copies)
        return [MergeStep(self.coefficients, self.strengths)] if self.coefficients else []


class HDETController:
    """Turns intervals into decisions; owns the vote rule's state and the permutation generator (the votes' record:
    :attr:`ledger`).

    It runs the rule objects of ``config`` as they are: ``config.vote``'s ``explore`` (on a fresh copy of it, which
    holds the state), ``config.safety_net``'s ``judge`` and plateau rule, ``config.signal``'s ``scores``."""

    def __init__(self, config: HDETConfig) -> None:
        self.config = config
        self.rule: Vote = config.vote.fresh()
        self.collapse_history = CollapseHistory()
        net = config.safety_net
        self.plateau = net.plateau if net is not None and net.plateau is not None else PlateauRule(steps=None)
        self.plateau_history = PlateauHistory()
        self.run_steps: Optional[int] = None  # the run's length where known (the callback sizes it): plateau patience
        self.plateau_cuts = 0  # votes at which every group was stuck: a roll-back onto the downward ladder
        self.plateau_armed = False  # whether the run has failed yet: only then may a plateau count as stuck
        self.rose_seen = False  # some group's loss (or training-loss bin) rose above its start: LRs may be too high
        self._generator = LazyGenerator()  # built on first use; pickles as bytes, to cross a spawn
        self.ledger = VoteLedger()  # the votes' rows and counters
        self.last_coefficients: list[float] = []
        self.search_phase = SearchPhase(config.search)

    @property
    def generator(self) -> torch.Generator:
        """The generator of the rule's permutations (seeded by ``config.seed``; the global RNG is never touched)."""
        return self._generator.get(self.config.seed)

    # The ledger's, read by the callback, the Fabric loop and the results.
    @property
    def history(self) -> list[dict[str, Any]]:
        """Every vote's rows (:class:`VoteLedger`)."""
        return self.ledger.history

    @property
    def rescues(self) -> int:
        """Groups rescued so far, summed over the votes."""
        return self.ledger.rescues

    @property
    def num_votes(self) -> int:
        """Votes so far (the final merge only at a roll-back)."""
        return self.ledger.num_votes

    @property
    def last_winner(self) -> int:
        """The last vote's winner (-1: none yet)."""
        return self.ledger.last_winner

    @property
    def initial_lrs(self) -> list[float]:
        """Every group's real LR (first param group) when training started (:attr:`VoteLedger.initial_lrs`)."""
        return self.ledger.initial_lrs

    @initial_lrs.setter
    def initial_lrs(self, lrs: list[float]) -> None:
        self.ledger.initial_lrs = lrs

    @property
    def keeps_initial(self) -> bool:
        """Whether the strategy should hold the initial model: the plateau rule's ladder restarts half of it there,
        and a search that ends on a low LR every group (``Search.restart_below``)."""
        search = self.config.search
        return (self.config.safety_net is not None and self.plateau.steps is not None) or (
            search is not None and search.restart_below is not None)

    @property
    def searched_at(self) -> Optional[int]:
        """The step of the vote that ended the search (:class:`SearchPhase`), ``None`` before."""
        return self.search_phase.searched_at

    @property
    def restarted_at(self) -> Optional[int]:
        """The step of that vote if it restarted every group from the initial model, else ``None``."""
        return self.search_phase.restarted_at

    def search_ends(self, step: int) -> bool:
        """Whether a vote at ``step`` ends the search (``search_phase.steps``; it ends once)."""
        return self.search_phase.ends(step)

    # ------------------------------------------------------------------ the vote
    def decide(self, interval: Interval) -> Decision:
        """One vote: safety net -> roll-back or (weights, winner, new multipliers, merge plan)."""
        losses, num_groups = list(interval.losses), len(interval.losses)
        progress, errors = self._evidence(interval)
        verdict, plateau = self._judge_plateau(interval, self._judge(interval, progress, errors), progress, errors)
        healthy = [not r for r in verdict.diverged]
        # With a shared gradient a group whose *loss* blew up sent huge, still finite gradients into every group
        # before it was caught: nothing from this interval is kept. (Non-finite gradients alone were kept out of
        # the average by the strategy's guard, so those rescues leave the healthy groups alone.)
        net = self.config.safety_net
        blew_up = divergent(losses, [True] * num_groups, net.divergence_factor if net is not None else None)
        contaminated = interval.shared_gradients and any(r and b for r, b in zip(verdict.diverged, blew_up))
        roll_back = num_groups > 1 and (not any(healthy) or contaminated)
        self.collapse_history = advance(self.collapse_history, verdict, losses, roll_back, interval.first_losses,
                                        interval.first_errors)
        self.plateau_history = forget(self.plateau_history, restarted=plateau.all_stuck)
        # Told to end the search, or early (Search.evidence); if it may not end yet, an ordinary vote: the next tries.
        ends = self.search_phase.ends_here(interval, healthy, self.collapse_history, progress and errors is not None)
        interval = replace(interval, refine=ends)
        decision = self._roll_back(interval, verdict.diverged) if roll_back else self._vote(interval, verdict.diverged)
        keep = net is None or net.keeps(verdict, losses, self.collapse_history)
        decision = replace(decision, keep=keep, reasons=verdict.reasons)
        if decision.explored:
            decision = replace(decision, values=values(decision.explored, interval.explored))
        if plateau.all_stuck:  # no group improves at any LR: a geometric search downward (plateau.py)
            table = ladder(interval.multipliers, self.plateau.cut)
            decision = replace(decision, multipliers=table, lrs=_lrs(table, interval),
                               from_initial=from_initial(table) if decision.roll_back else [])
            self.plateau_cuts += 1
        self.ledger.record(decision, interval, edge_of(interval.multipliers[:, 0].tolist(), decision.winner),
                    _clear(losses, errors, decision.winner, [not r for r in decision.rescued]))
        return decision

    def _judge(self, interval: Interval, progress: bool, errors: Optional[list[float]]) -> Verdict:
        """The safety net's verdict (nobody diverged when it is off); progress is not judged before warm-up, nor at
        the final merge (its interval is often a fragment of a few steps, and a roll-back there would throw away
        the end of the run on that little evidence; non-finite and ``x best`` groups are still kept out)."""
        num_groups, net = len(interval.losses), self.config.safety_net
        if net is None:
            return Verdict([False] * num_groups, [""] * num_groups, [0] * num_groups)
        return net.judge(self.collapse_history, interval.losses, interval.finite, progress, errors)

    def _evidence(self, interval: Interval) -> tuple[bool, Optional[list[float]]]:
        """What the progress rules may judge by: whether progress is judged at all (after warm-up, not at the final
        merge), and each group's interval standard error from its loss curve (None with ``monitor``: the losses
        are then not the curve's means)."""
        progress = interval.step >= self.config.warmup_steps and not interval.final
        curve = interval.curves is not None and self.config.monitor is None
        return progress, [curve_error(row) for row in interval.curves.tolist()] if curve else None

    def _judge_plateau(self, interval: Interval, verdict: Verdict, progress: bool,
                       errors: Optional[list[float]]) -> tuple[Verdict, PlateauVerdict]:
        """The other rules' verdict with the plateau rule's failures added, and the plateau rule's own verdict
        (:mod:`~lightning_hdet.hdet.rules.plateau`; judged like the progress rules: not before warm-up nor at the end)."""
        rule = self.plateau
        steps = patience(rule, self.run_steps, self.config.every_n_steps, self.plateau_cuts)
        rule = replace(rule, steps=judged_at(steps, self.run_steps, interval.step))
        # The plateau rule acts only once the run has shown a failure (plateau.py): a group caught, now or before,
        # or a loss above its starting level (a collapse knocked above it that no other rule caught). Where the votes
        # read a validation metric (``monitor``), a training-loss bin above it counts too (``rose_seen``, from the last
        # vote's curves): the validation may be back at the untrained level by then. Not where the votes read the
        # training loss itself, whose rises the vote's losses show: there a bin above the start is one probe's first
        # steps at too high an LR, and arming on it let the ladder cut every LR 10-100x mid-run from a good start
        # (benchmark 2's MLP, every seed: research log 2026-12-07).
        rose = self.rose_seen and self.config.monitor is not None
        rose = rose or (self.config.monitor is not None and progress and  # a run memorising its data (plateau.py)
                        memorising(self.plateau_history, interval.losses, verdict))
        self.plateau_armed = self.plateau_armed or self.rescues > 0 or any(verdict.diverged) or rose or \
            rose_above_start(self.collapse_history.sized(len(interval.losses)), interval.losses)
        plateau = judge_plateau(rule, self.plateau_history, verdict, interval.losses, interval.step, errors, progress,
                                self.plateau_armed)
        self.plateau_history = plateau.history
        return plateau.applied(verdict), plateau

    def _scores(self, interval: Interval, healthy: Sequence[bool]) -> list[float]:
        """What the vote compares: the signal's scores (a curve's, the held-out losses), or the interval losses
        themselves (at the final merge, which picks by level, and whenever a healthy group has no finite score)."""
        losses = list(interval.losses)
        signal = None if interval.final else self.config.signal.scores(interval, self.config.every_n_steps)
        if signal is None:
            return losses
        return signal if all(math.isfinite(x) for x, ok in zip(signal, healthy) if ok) else losses

    def _vote(self, interval: Interval, rescued: list[bool]) -> Decision:
        losses, num_groups = list(interval.losses), len(interval.losses)
        healthy = [not r for r in rescued]
        ending = interval.final or interval.refine  # picks by level, merges fully, leaves the rule alone
        move = not ending and interval.step >= self.config.warmup_steps and num_groups > 1
        signal = self._scores(interval, healthy)
        table = interval.multipliers.clone()
        weights, winner, sources = [1.0 / num_groups] * num_groups, 0, list(range(num_groups))
        going = self._direction(interval, healthy)
        for p, schedule_lr in enumerate(interval.schedule_lrs):
            ballot = Ballot(p, signal, table[:, p].tolist(), healthy, schedule_lr, move, going)
            result = self.rule.explore(ballot, self.generator)
            if interval.explored.lr:  # (explore={"lr": 1.0}: the ballot still weighs and picks the winner)
                table[:, p] = torch.tensor(result.multipliers, dtype=torch.float64)
            if p == 0:
                weights, winner = result.weights, result.winner
                sources = result.sources if isinstance(result, Selection) else sources
        explored = vote_explored(self.rule, self.generator, interval.explored, signal, healthy, move)
        coefficients: list[float] = []
        strengths: list[float] = []
        strength = 1.0 if ending else self.rule.strength
        copies = copy_plan(sources, strength, rescued) if num_groups > 1 else []
        if num_groups > 1 and not copies:
            # PBT ends on its best group, and so does a search; before warm-up PBT merges like the other votes.
            ending_on_best = interval.refine or (interval.final and self.rule.copies)
            blend = "best" if ending_on_best else self.rule.blend
            coefficients = blend_coefficients(blend, weights, winner, healthy)
            strengths = blend_strengths(strength, rescued)
        if num_groups > 1:
            # What finishing this vote's merge means at the end of fit: a PBT copy vote ends on its winner.
            self.last_coefficients = coefficients or [1.0 if g == winner else 0.0 for g in range(num_groups)]
        log.debug("vote at step %d: losses %s, signal %s, weights %s, winner %d, rescued %s", interval.step, losses,
                  signal, weights, winner, rescued)
        refined = interval.refine and winner >= 0 and num_groups > 1
        restart, warning = [], ""
        if refined:
            grid, restart, warning = self.search_phase.end(interval, table[winner].tolist())
            self.rule.load_state_dict(self.rule.carried())  # afresh on the grid: its state described the search
            if restart:
                # Each group's history described the search's models: the climb back from the initial one is no rise.
                # The plateau rule keeps the ensemble's best and its clock: a restart not below it within its patience
                # is stuck (LRs 30-100x too high in tests/test_plateau_fit.py, left at chance by a fresh clock).
                self.collapse_history = restarted(self.collapse_history)
            table = grid if interval.explored.lr else table  # (explore={"lr": 1.0}: the LRs stay)
            explored = refined_tables(explored, winner, self.search_phase.refine_spread)
        elif going < 0 and interval.holds_initial and self.keeps_initial:
            restart = below_grid(interval.multipliers[:, 0].tolist(), table[:, 0].tolist(), sources)
            self.collapse_history = restarted(self.collapse_history, restart) if restart else self.collapse_history
        table = self._cut(table, rescued)
        return Decision(interval.step, losses, weights, winner, table, _lrs(table, interval), rescued, False,
                        coefficients, strengths, copies, refined=refined, from_initial=restart, explored=explored,
                        warning=warning)

    def _direction(self, interval: Interval, healthy: Sequence[bool]) -> int:
        """:attr:`Ballot.direction` (:mod:`~lightning_hdet.hdet.rules.direction`), inside the search (``Search``, not
        yet ended: it ends only on a winner that learned) and after warm-up; it remembers whether a group rose
        (``rose_seen``). After the search, or without one, a flat loss is no reason to travel: a converged run or a
        fine-tune moves little, and ties there must not walk the LRs up vote after vote."""
        rose = risen_now(self.collapse_history, interval.losses, interval.curves)
        failed_before = self.plateau_armed or self.rose_seen
        self.rose_seen = self.rose_seen or any(rose)
        phase = self.search_phase
        if interval.final or interval.step < self.config.warmup_steps or phase.steps is None or phase.searched_at:
            return 0
        return direction(self.collapse_history, interval.losses, healthy, rose, failed_before)

    def _roll_back(self, interval: Interval, rescued: list[bool]) -> Decision:
        """Every group returns to the last good merged model; the rescued groups' LRs are cut (all, if all)."""
        losses, num_groups = list(interval.losses), len(interval.losses)
        self.last_coefficients = [1.0 / num_groups] * num_groups
        winner = winner_of(losses, [not r for r in rescued])
        weights = [1.0 if g == winner else 0.0 for g in range(num_groups)]
        log.debug("roll-back at step %d: losses %s, rescued %s", interval.step, losses, rescued)
        table = self._cut(interval.multipliers.clone(), rescued)
        return Decision(interval.step, losses, weights, winner, table, _lrs(table, interval), rescued, True,
                        explored=dict(interval.explored.tables))

    def _cut(self, table: Tensor, rescued: Sequence[bool]) -> Tensor:
        """Multiply the rescued groups' rows of the multiplier table by ``rescue_lr_factor`` (in place)."""
        for g, bad in enumerate(rescued):
            if bad:
                table[g] *= self.config.safety_net.rescue_lr_factor
        return table

    def finishing_merge(self) -> tuple[list[float], list[float]]:
        """Coefficients and strengths that finish the last vote's merge at full strength (nothing trained since)."""
        rescued = [c == 0.0 for c in self.last_coefficients]
        return list(self.last_coefficients), blend_strengths(1.0, rescued)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.state_dict(),
            "generator": self.generator.get_state(),
            **self.ledger.state_dict(),  # "history", "rescues", "num_votes", "last_winner", "initial_lrs"
            "last_coefficients": list(self.last_coefficients),
            "collapse": self.collapse_history.state_dict(),
            **self.search_phase.state_dict(),  # "searched_at", "restarted_at"
            "plateau": self.plateau_history.state_dict(),
            "plateau_cuts": self.plateau_cuts,
            "plateau_armed": self.plateau_armed,
            **({"rose_seen": True} if self.rose_seen else {}),  # (none yet: left out, as in checkpoints before it)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rule.load_state_dict(state_dict["rule"])
        self.generator.set_state(state_dict["generator"])
        self.ledger.load_state_dict(state_dict)
        self.last_coefficients = list(state_dict["last_coefficients"])
        self.collapse_history.load_state_dict(state_dict["collapse"])
        self.search_phase.load_state_dict(state_dict)
        self.plateau_history.load_state_dict(state_dict["plateau"])
        self.plateau_cuts = state_dict["plateau_cuts"]
        self.plateau_armed = state_dict["plateau_armed"]
        self.rose_seen = state_dict.get("rose_seen", False)  # (absent from older checkpoints)


# Standard errors by which the winner must lead the runner-up for a vote to count as decided (a one-look test).
CLEAR_Z = 2.0


def _clear(losses: Sequence[float], errors: Optional[Sequence[float]], winner: int,
           healthy: Sequence[bool]) -> Optional[bool]:
    """Whether the winner led the runner-up by more than ``CLEAR_Z`` standard errors of the difference (each group's
    from its loss curve); ``None`` where it cannot be said (no curve errors, e.g. with ``monitor``, or fewer than
    two healthy groups)."""
    others = [g for g in range(len(losses)) if healthy[g] and g != winner and math.isfinite(losses[g])]
    if errors is None or winner < 0 or not others:
        return None
    second = min(others, key=lambda g: losses[g])
    spread = math.hypot(errors[winner], errors[second])
    if not (math.isfinite(spread) and spread > 0):
        return None
    return losses[second] - losses[winner] > CLEAR_Z * spread


def _lrs(table: Tensor, interval: Interval) -> list[float]:
    """Real learning rates of the first param group: multiplier x schedule LR (what the strategy will apply)."""
    schedule = float(interval.schedule_lrs[0]) if len(interval.schedule_lrs) else 0.0
    return (table[:, 0] * schedule).tolist()
