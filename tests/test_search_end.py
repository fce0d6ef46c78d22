"""``Search(evidence=z)``: a vote of the search ends it once every group outside the refine grid clearly lost; the
search's end as its own object (:class:`SearchPhase`) and in the controller's checkpoints (pure: hand-computed values,
the controller in one process)."""

from __future__ import annotations

import math

from dataclasses import replace

import pytest
import torch

from lightning_hdet import Search
from lightning_hdet.hdet.rules.collapse import CollapseHistory
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.search_end import SearchPhase, detrended_error, evidence_is_in, refine_span

PATTERN = [0.0, 0.1, -0.1, 0.0]  # about its line (slope -0.02): residuals -0.03, 0.09, -0.09, 0.03


def _row(means, count=2):
    """A gathered loss-curve row: bin sums, then counts (``count`` steps per bin)."""
    return [m * count for m in means] + [count] * len(means)


def test_the_detrended_error_is_the_scatter_about_the_bins_line():
    # residuals^2 sum to 0.018; / (n - 2) = 0.009; / n = 0.00225; sqrt = 0.0474342
    assert detrended_error(_row([1.0 + p for p in PATTERN])) == pytest.approx(0.0474342, abs=1e-6)
    # a falling loss with the same scatter: the fall is not noise
    assert detrended_error(_row([2.0 - 0.3 * b + p for b, p in enumerate(PATTERN)])) == pytest.approx(0.0474342,
                                                                                                       abs=1e-6)
    assert detrended_error(_row([3.0, 2.0, 1.0, 0.0])) == pytest.approx(0.0)  # a straight line: no scatter
    assert detrended_error(_row([1.0, 2.0])) == 0.0  # two bins: nothing left once a line is fitted
    assert detrended_error([2.0, 0.0, 4.0, 2.0, 0.0, 2.0]) == 0.0  # three bins, one empty: two left


def test_the_refine_grid_reaches_ratio_to_the_half_groups_either_side():
    assert refine_span(4, 1.5) == pytest.approx(1.5**1.5)  # 0.544x to 1.837x
    assert refine_span(2, 4.0) == pytest.approx(2.0)


@pytest.mark.parametrize(("lrs", "losses", "ends"), [
    ((0.44, 1.0, 2.3, 5.2), (2.0, 1.5, 1.6, 2.4), False),  # 2.3x is outside and only 0.1 behind (< 2.5 x 0.141)
    ((0.44, 1.0, 2.3, 5.2), (2.0, 1.5, 1.9, 2.4), True),  # every group outside lost by > 0.354
    ((0.44, 1.0, 1.5, 5.2), (2.0, 1.5, 1.6, 2.4), True),  # 1.5x is inside the grid: it need not have lost
    ((0.7, 1.0, 1.5, 1.8), (2.0, 1.5, 1.6, 2.4), False),  # nothing outside the grid: nothing was ruled out
], ids=["close-neighbour-outside", "all-lost", "close-neighbour-inside", "all-inside"])
def test_the_evidence_is_in_when_every_group_outside_the_grid_lost_by_z_standard_errors(lrs, losses, ends):
    errors = [0.1] * 4  # the difference of two means: 0.1 x sqrt(2) = 0.1414; x 2.5 = 0.354
    assert evidence_is_in(losses, errors, [True] * 4, lrs, 1, refine_span(4, 1.5), 2.5) is ends


def test_no_evidence_from_an_unknown_error_or_an_unhealthy_winner():
    lrs, losses, span = (0.44, 1.0, 2.3, 5.2), (2.0, 1.5, 1.9, 2.4), refine_span(4, 1.5)
    assert not evidence_is_in(losses, [0.1, 0.0, 0.1, 0.1], [True] * 4, lrs, 1, span, 2.5)
    assert not evidence_is_in(losses, [0.1] * 4, [True, False, True, True], lrs, 1, span, 2.5)
    # an unhealthy loser is left out of the test (the safety net handles it)
    assert evidence_is_in((2.0, 1.5, 1.9, 9.0), [0.1, 0.1, 0.1, float("nan")], [True, True, True, False], lrs, 1,
                          span, 2.5)


def _interval(step: int, losses, multipliers, scatter: float) -> Interval:
    """Four groups whose loss curves fall by 0.3 per bin around their interval means, with ``scatter`` x the
    pattern about that line (so each group's detrended error is ``scatter x 0.474``)."""
    curves = torch.tensor([_row([loss + 0.45 - 0.3 * b + scatter * p for b, p in enumerate(PATTERN)])
                           for loss in losses], dtype=torch.float64)
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    return Interval(step, losses, [True] * 4, table, [0.1], False, curves=curves)


@pytest.mark.parametrize(("evidence", "scatter", "ends"), [(2.5, 1.0, True), (2.5, 4.0, False), (None, 1.0, False)],
                         ids=["clear", "noisy", "off"])
def test_a_vote_of_the_search_ends_it_early_once_the_evidence_is_in(evidence, scatter, ends):
    """Leads of 0.5 and more over the groups outside the grid: with errors 0.047 (difference 0.067, x 2.5 = 0.168) the
    search ends at step 16, long before ``steps``; with four times the scatter (0.671) it does not."""
    controller = HDETController(HDETConfig(search=Search(steps=300, evidence=evidence), safety_net=None))
    controller.search_phase.steps = 300  # (the callback sizes it from the run)
    decision = controller.decide(_interval(16, [2.0, 1.5, 2.0, 2.6], (0.44, 1.0, 2.3, 5.2), scatter))
    assert decision.refined is ends and controller.searched_at == (16 if ends else None)
    if ends:
        assert decision.winner == 1 and decision.restart == [True] * 4
        assert decision.multipliers[:, 0].tolist() == pytest.approx([1.5**k for k in (-1.5, -0.5, 0.5, 1.5)])
        assert not controller.search_ends(300)  # it ended once


def test_no_early_end_before_warm_up_or_after_the_search_and_none_with_monitor():
    """With `monitor` the votes read no training-loss curve to weigh: `evidence` is refused, not ignored."""
    interval = _interval(16, [2.0, 1.5, 2.0, 2.6], (0.44, 1.0, 2.3, 5.2), 1.0)
    search = Search(steps=300, evidence=2.5)
    with pytest.raises(ValueError, match="`search` must be a Search without `evidence` when the votes read `monitor`"):
        HDETConfig(search=search, safety_net=None, monitor="val_loss")
    controller = HDETController(HDETConfig(search=search, safety_net=None, warmup_steps=32))
    controller.search_phase.steps = 300
    assert not controller.decide(interval).refined
    controller = HDETController(HDETConfig(search=search, safety_net=None))
    controller.search_phase.steps = 300
    assert controller.decide(replace(interval, refine=True)).refined  # the search ends at `steps`, once
    assert not controller.decide(replace(interval, step=32)).refined


def test_evidence_must_be_a_positive_number():
    with pytest.raises(ValueError, match="`evidence` must be a finite number > 0 or None, got 0"):
        Search(evidence=0)


def _vote(step: int, losses, multipliers, holds_initial: bool = True, refine: bool = True) -> Interval:
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    return Interval(step, losses, [True] * len(losses), table, [0.1], False, refine=refine,
                    holds_initial=holds_initial)


def test_the_search_phase_ends_at_the_first_vote_at_or_after_its_steps_and_only_once():
    assert SearchPhase(None).steps is None and not SearchPhase(None).ends(10**6)  # no search end: never
    phase = SearchPhase(Search(steps=6))
    assert [phase.ends(step) for step in (4, 5, 6, 8)] == [False, False, True, True]
    phase.end(_vote(8, [2.0, 1.0], (1.0, 3.0)), [3.0])
    assert phase.searched_at == 8 and not phase.ends(8) and not phase.ends(12)
    phase.steps = 20  # (the callback sizes it from the run): it has ended all the same
    assert not phase.ends(24)


@pytest.mark.parametrize(("centre", "restarts"), [(0.25, True), (1 / 3, True), (0.5, False)],
                         ids=["below", "at-the-bound", "above"])
def test_the_search_ends_on_a_grid_around_the_winner_and_restarts_below_restart_below(centre, restarts):
    """Two groups, ``refine_spread=2``: the grid is centre / sqrt(2), centre x sqrt(2); at or below
    ``restart_below=1/3`` (x (1 + 1e-9)) every group restarts from the initial model, above it none does."""
    phase = SearchPhase(Search(refine_spread=2.0, restart_below=1 / 3))
    grid, restart, warning = phase.end(_vote(8, [1.0, 2.0], (centre, 3.0)), [centre])
    assert grid[:, 0].tolist() == pytest.approx([centre / 2**0.5, centre * 2**0.5]) and warning == ""
    assert restart == ([True, True] if restarts else []) and phase.searched_at == 8
    assert phase.restarted_at == (8 if restarts else None)
    assert SearchPhase(Search(restart_below=None)).end(_vote(8, [1.0, 2.0], (0.01, 3.0)), [0.01])[1] == []


def test_a_restart_without_an_initial_model_held_is_a_warning():
    phase = SearchPhase(Search())  # restart_below=1/3
    grid, restart, warning = phase.end(_vote(12, [1.0, 2.0, 3.0], (0.1, 1.0, 2.0), holds_initial=False), [0.1])
    assert restart == [] and phase.restarted_at is None and phase.searched_at == 12
    assert grid[:, 0].tolist() == pytest.approx([0.1 / 1.5, 0.1, 0.15])
    assert warning == (
        "HDET: step 12: the search ended at 0.1x the optimizer's LR, at or below Search(restart_below=0.333), but no "
        "initial model is held (a run resumed from a checkpoint keeps none): every group trains on from the winner's "
        "model.")


def test_a_vote_told_to_refine_ends_the_search_only_on_a_winner_below_its_starting_noise_band():
    """Starting levels 1.79 +- 0.01: the winner must be below 1.79 - 2 x 0.01 = 1.77."""
    phase = SearchPhase(Search(steps=4))
    history = CollapseHistory([1.79, 1.79], [1.79, 1.79], [0, 0], [0.01, 0.01], [False, False])
    healthy = [True, True]
    assert not phase.ends_here(_vote(4, [1.775, 1.79], (1.0, 2.0)), healthy, history, curves=True)
    assert phase.ends_here(_vote(4, [1.769, 1.79], (1.0, 2.0)), healthy, history, curves=True)
    not_asked = _vote(4, [1.5, 1.79], (1.0, 2.0), refine=False)
    assert not phase.ends_here(not_asked, healthy, history, curves=True)
    assert not phase.ends_here(_vote(4, [1.5, 1.79], (1.0, 2.0)), [False, False], history, curves=True)  # no winner
    # the starting level unknown
    assert phase.ends_here(_vote(4, [1.785, 1.79], (1.0, 2.0)), healthy, CollapseHistory(), curves=True)


def _checkpoint(searched_at, restarted_at) -> dict:
    """A controller checkpoint as written before the search's end had its own object, built by hand."""
    return {"rule": {}, "generator": torch.Generator().manual_seed(7).get_state(),
            "history": [{"step": 8, "group": 0, "lr": 0.05, "loss": 1.0, "weight": 1.0, "winner": 0,
                         "rescued": False, "reason": ""}],
            "rescues": 1, "num_votes": 2, "last_winner": 0, "last_coefficients": [1.0, 0.0],
            "collapse": {"start": [2.0, 2.0], "previous": [1.0, 1.2], "stalled": [0, 1], "start_error": [0.01, 0.01],
                         "left": [True, True]},
            "searched_at": searched_at, "restarted_at": restarted_at,
            "plateau": {"best": 1.0, "stuck_steps": 4, "last_step": 8}, "plateau_cuts": 0, "plateau_armed": True}


@pytest.mark.parametrize(("searched_at", "restarted_at"), [(8, 8), (8, None), (None, None)])
def test_a_checkpoint_from_before_the_search_phase_loads_and_round_trips(searched_at, restarted_at):
    old = _checkpoint(searched_at, restarted_at)
    controller = HDETController(HDETConfig(search=Search(steps=4)))
    controller.load_state_dict(old)
    assert (controller.searched_at, controller.restarted_at) == (searched_at, restarted_at)
    assert controller.search_ends(12) is (searched_at is None)
    new = controller.state_dict()
    # its rows predate `trained_lr`: the first vote's is unknown (the initial LRs were not kept), the rest round-trips
    assert [math.isnan(row.pop("trained_lr")) for row in new["history"]] == [True]
    assert list(new) == list(old) and torch.equal(new.pop("generator"), old.pop("generator")) and new == old


def test_a_checkpoint_older_than_restart_below_loads_without_restarted_at():
    old = _checkpoint(8, None)
    del old["restarted_at"]
    controller = HDETController(HDETConfig(search=Search()))
    controller.load_state_dict(old)
    assert controller.searched_at == 8 and controller.restarted_at is None
    assert controller.state_dict()["restarted_at"] is None
