"""The HDET controller as a pure object: one interval in, one decision out, against hand-computed values."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
import torch

from lightning_hdet.experimental import PartialMerge
from lightning_hdet.hdet.hyperparams import Explored
from lightning_hdet.hdet.multipliers import centred_grid
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.options import PBT, Best, SafetyNet, Search, Softmax


def _interval(losses, finite=None, multipliers=(0.5, 1.5), step=4, shared=False, final=False, lr=0.1):
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    finite = [True] * len(losses) if finite is None else finite
    return Interval(step, losses, finite, table, [lr], shared, final)


def test_softmax_vote_weights_multipliers_and_merge_by_hand():
    controller = HDETController(HDETConfig(vote=Softmax(temperature=1.0, momentum=0.5, meta_lr=1.0, permute=False)))
    decision = controller.decide(_interval([2.0, 1.0]))
    # weights = softmax((mean - L) / T) = softmax([-0.5, 0.5])
    w1 = math.exp(0.5) / (math.exp(0.5) + math.exp(-0.5))
    assert decision.weights == pytest.approx([1 - w1, w1]) and decision.winner == 1
    # lrs 0.05, 0.15; delta = sum w lr - mean lr; v = 0.5 * delta; base 0.1 -> 0.1 + v; shape (0.5, 1.5) kept
    delta = (1 - w1) * 0.05 + w1 * 0.15 - 0.1
    base = 0.1 + 0.5 * delta
    assert decision.multipliers[:, 0].tolist() == pytest.approx([base / 0.1 * 0.5, base / 0.1 * 1.5])
    assert decision.lrs == pytest.approx([base * 0.5, base * 1.5])
    assert decision.coefficients == [0.5, 0.5] and decision.strengths == [1.0, 1.0]
    assert not decision.roll_back and decision.rescued == [False, False]
    assert (controller.num_votes, controller.last_winner, controller.rescues) == (1, 1, 0)
    assert [h["weight"] for h in controller.history] == pytest.approx(decision.weights)


def test_warmup_and_final_leave_multipliers_alone():
    controller = HDETController(HDETConfig(vote=PartialMerge(Softmax(blend="best"), strength=0.5), warmup_steps=10))
    decision = controller.decide(_interval([2.0, 1.0], step=4))
    assert decision.multipliers[:, 0].tolist() == [0.5, 1.5]
    assert decision.coefficients == [0.0, 1.0] and decision.strengths == [0.5, 0.5]
    final = controller.decide(_interval([2.0, 1.0], step=20, final=True))
    assert final.multipliers[:, 0].tolist() == [0.5, 1.5] and final.strengths == [1.0, 1.0]
    assert controller.num_votes == 1  # the final merge is no vote


def test_rescue_cuts_the_diverged_group_and_keeps_it_out_of_the_merge():
    controller = HDETController(HDETConfig(vote=Softmax(permute=False, meta_lr=0.0),
                                           safety_net=SafetyNet(rescue_lr_factor=0.25)))
    decision = controller.decide(_interval([1.0, 1.0, 50.0], multipliers=(1.0, 2.0, 4.0)))  # 50 > 10 x 1
    assert decision.rescued == [False, False, True] and not decision.roll_back
    assert decision.multipliers[:, 0].tolist() == pytest.approx([1.0, 2.0, 1.0])
    assert decision.coefficients == [0.5, 0.5, 0.0] and decision.strengths == [1.0, 1.0, 1.0]
    assert controller.rescues == 1


def test_roll_back_when_a_loss_blew_up_under_shared_gradients_or_all_diverged():
    controller = HDETController(HDETConfig(vote=Softmax(permute=False)))
    decision = controller.decide(_interval([1.0, 50.0], shared=True))
    assert decision.roll_back and decision.rescued == [False, True] and decision.winner == 0
    assert decision.weights == [1.0, 0.0] and decision.multipliers[:, 0].tolist() == [0.5, 0.75]
    assert controller.last_coefficients == [0.5, 0.5]
    everyone = controller.decide(_interval([1.0, 1.0], finite=[False, False]))
    assert everyone.roll_back and everyone.winner == -1 and everyone.multipliers[:, 0].tolist() == [0.25, 0.75]
    assert controller.num_votes == 2 and controller.rescues == 3
    # non-finite gradients alone (finite loss) under shared gradients: a rescue, no roll-back
    assert not controller.decide(_interval([1.0, 1.0], finite=[True, False], shared=True)).roll_back


def test_finishing_merge_repeats_the_last_coefficients_at_full_strength():
    controller = HDETController(HDETConfig(vote=PartialMerge(Softmax(blend="weighted"), strength=0.5)))
    decision = controller.decide(_interval([2.0, 1.0]))
    coefficients, strengths = controller.finishing_merge()
    assert coefficients == decision.coefficients and strengths == [1.0, 1.0]


def test_state_round_trip_and_pickling_keep_the_generator():
    config = HDETConfig(seed=5)
    controller = HDETController(config)
    for _ in range(3):
        controller.decide(_interval([1.0, 2.0, 3.0], multipliers=(0.5, 1.0, 1.5)))
    copy = HDETController(config)
    copy.load_state_dict(controller.state_dict())
    unpickled = pickle.loads(pickle.dumps(controller))
    nxt = [c.decide(_interval([1.0, 2.0, 3.0], multipliers=(0.5, 1.0, 1.5))).multipliers for c in
           (controller, copy, unpickled)]
    assert torch.equal(nxt[0], nxt[1]) and torch.equal(nxt[0], nxt[2])
    assert copy.history == controller.history and copy.num_votes == 4


def test_centred_grid_by_hand():
    table = centred_grid([2.0, 0.2], 3, 1.5)
    torch.testing.assert_close(table, torch.tensor([[2.0 / 1.5, 0.2 / 1.5], [2.0, 0.2], [3.0, 0.3]], dtype=torch.float64))
    assert centred_grid([1.0], 4, 4.0)[:, 0].tolist() == pytest.approx([1 / 8, 1 / 2, 2.0, 8.0])
    assert centred_grid([0.7], 2, 1.0)[:, 0].tolist() == [0.7, 0.7]


@pytest.mark.parametrize("vote", ["pbt", "softmax", "best"])
def test_the_search_ends_on_the_winner_with_a_narrow_grid_around_its_lr(vote):
    rule = {"pbt": PBT(), "softmax": Softmax(blend="mean"), "best": Best(blend="mean")}[vote]
    controller = HDETController(HDETConfig(vote=PartialMerge(rule, strength=0.5), search=Search(refine_spread=2.0)))
    controller.decide(_interval([3.0, 2.0, 1.0], multipliers=(0.5, 1.0, 4.0), step=4))  # the rule's state moves
    searched = _interval([3.0, 1.0, 2.0], multipliers=(0.5, 1.0, 4.0), step=8)
    decision = controller.decide(replace(searched, refine=True))
    # winner by level (group 1, multiplier 1.0); its model in full for everyone; every optimizer restarts
    assert decision.refined and decision.winner == 1 and controller.searched_at == 8
    assert decision.coefficients == [0.0, 1.0, 0.0] and decision.strengths == [1.0, 1.0, 1.0]
    assert decision.restart == [True, True, True] and decision.rescued == [False, False, False]
    assert decision.multipliers[:, 0].tolist() == pytest.approx([0.5, 1.0, 2.0])
    assert decision.lrs == pytest.approx([0.05, 0.1, 0.2])
    assert controller.num_votes == 2
    # the rule starts afresh from the new grid: a fresh controller at the same table votes the same way
    fresh = HDETController(HDETConfig(vote=Softmax(permute=False) if vote == "softmax" else type(rule)()))
    after = _interval([2.0, 1.0, 3.0], multipliers=(0.5, 1.0, 2.0), step=12)
    if vote == "best":
        assert controller.rule.state_dict() == {"spread": {}}
        expected = fresh.decide(after).multipliers
        assert sorted(controller.decide(after).multipliers[:, 0].tolist()) == pytest.approx(
            sorted(expected[:, 0].tolist()))
    restored = HDETController(HDETConfig(vote=type(rule)()))
    restored.load_state_dict(controller.state_dict())
    assert restored.searched_at == 8


def test_no_search_end_at_a_roll_back():
    controller = HDETController(HDETConfig(vote=PBT()))
    decision = controller.decide(replace(_interval([1.0, 1.0], finite=[False, False]), refine=True))
    assert decision.roll_back and not decision.refined and controller.searched_at is None
    assert decision.restart == [True, True]  # both rescued


def test_the_search_waits_for_a_winner_below_its_starting_level():
    """Every group still at the untrained model's loss (1.79 +- 2 x 0.01): the search goes on with an ordinary vote;
    at the next vote the winner is below 1.77, and the search ends there."""
    controller = HDETController(HDETConfig(search=Search(steps=4)))
    first = replace(_interval([1.785, 1.79], step=4), first_losses=[1.79, 1.79], first_errors=[0.01, 0.01],
                    refine=True)
    plateau = controller.decide(first)
    assert not plateau.refined and controller.searched_at is None and controller.search_ends(8)
    assert plateau.restart == [False, False]
    left = controller.decide(replace(_interval([1.60, 1.78], step=8), refine=True))
    assert left.refined and left.winner == 0 and controller.searched_at == 8
    # without a known starting level (e.g. `monitor`) the search ends where it is asked to
    unknown = HDETController(HDETConfig(search=Search(steps=4)))
    assert unknown.decide(replace(_interval([1.785, 1.79], step=4), refine=True)).refined


def test_the_search_ends_once_at_the_first_vote_at_or_after_search_steps():
    assert not HDETController(HDETConfig()).search_ends(10**6)  # search_steps=None: a search for the whole run
    controller = HDETController(HDETConfig(search=Search(steps=6)))
    assert [controller.search_ends(step) for step in (4, 6, 8)] == [False, True, True]
    controller.decide(replace(_interval([2.0, 1.0], step=8), refine=True))
    assert controller.searched_at == 8 and not controller.search_ends(12)


@pytest.mark.parametrize(("centre", "below", "restarts"), [(0.25, 1 / 3, True), (1 / 3, 1 / 3, True),
                                                           (0.5, 1 / 3, False), (0.25, None, False)],
                         ids=["below", "at-the-bound", "above", "off"])
def test_a_search_ending_far_below_the_start_lr_restarts_every_group_from_the_initial_model(centre, below, restarts):
    """The winner (group 0, the lowest loss) sits at ``centre`` x the optimizer's LR: at or below ``restart_below``
    every group restarts from the initial model at the new grid (its geometric mean is ``centre``); above it, or
    with ``restart_below=None``, every group takes the winner's model as before. The decision is a checkpointed
    fact of the run."""
    search = Search(refine_spread=2.0, restart_below=below)
    controller = HDETController(HDETConfig(search=search, safety_net=None))
    decision = controller.decide(replace(_interval([1.0, 2.0], multipliers=(centre, 3.0), step=8), refine=True))
    assert decision.refined and decision.winner == 0 and decision.coefficients == [1.0, 0.0]
    assert decision.multipliers[:, 0].tolist() == pytest.approx([centre / 2**0.5, centre * 2**0.5])
    assert decision.from_initial == ([True, True] if restarts else []) and not decision.roll_back
    assert decision.warning == "" and controller.restarted_at == (8 if restarts else None)
    restored = HDETController(HDETConfig())
    restored.load_state_dict(controller.state_dict())
    assert restored.restarted_at == controller.restarted_at
    assert controller.keeps_initial == (below is not None)  # (no safety net: no plateau rule needs it)


def test_a_restart_from_the_initial_model_without_one_held_is_a_warning_and_the_winners_model_trains_on():
    controller = HDETController(HDETConfig(search=Search()))
    ended = replace(_interval([1.0, 2.0], multipliers=(0.1, 1.0), step=8), refine=True, holds_initial=False)
    decision = controller.decide(ended)
    assert decision.refined and decision.from_initial == [] and controller.restarted_at is None
    assert decision.warning == (
        "HDET: step 8: the search ended at 0.1x the optimizer's LR, at or below Search(restart_below=0.333), but no "
        "initial model is held (a run resumed from a checkpoint keeps none): every group trains on from the winner's "
        "model.")


def test_restart_below_must_be_a_fraction_of_the_lr():
    for bad in (0.0, 1.5, -1.0, float("nan")):
        with pytest.raises(ValueError, match="restart_below"):
            Search(restart_below=bad)
    assert Search(restart_below=1.0).restart_below == 1.0 and Search().restart_below == pytest.approx(1 / 3)


@pytest.mark.parametrize("below", [1 / 3, None], ids=["restarted", "not-restarted"])
def test_after_a_restart_from_the_initial_model_the_climb_back_to_the_start_is_not_a_rise(below):
    """Both groups fall from 2.0 to 0.5 / 0.9; the search ends on group 0 at x0.25. Restarted, the next interval
    is back near the start (1.9): the safety net's history was the search's models', so nothing is a rise. Without
    the restart the same losses are a rise on 0.5 and 0.9 (``rose``, both groups: a roll-back)."""
    controller = HDETController(HDETConfig(search=Search(restart_below=below), safety_net=SafetyNet()))
    start = {"first_losses": [2.0, 2.0], "first_errors": [0.01, 0.01]}
    controller.decide(replace(_interval([1.0, 1.2], multipliers=(0.25, 1.0), step=4), **start))
    ended = controller.decide(replace(_interval([0.5, 0.9], multipliers=(0.25, 1.0), step=8), refine=True))
    assert ended.refined and (controller.restarted_at == 8) == (below is not None)
    after = controller.decide(_interval([1.9, 1.9], multipliers=(0.25 / 1.5**0.5, 0.25 * 1.5**0.5), step=12))
    assert after.rescued == ([False, False] if below is not None else [True, True])
    assert [r for r in after.reasons if r] == ([] if below is not None else ["rose", "rose"])


def _rows(controller, step):
    return [row for row in controller.history if row["step"] == step]


def test_each_history_row_pairs_its_loss_with_the_lr_trained_at_and_keeps_the_lr_set_in_lr():
    # explore={"lr": 1.0}: the votes move no LR, only the safety net's cuts (x 0.25) do; the strategy applies each
    # decision's table before the next interval, and a scheduler halves the schedule LR between votes 1 and 2.
    controller = HDETController(HDETConfig(vote=Softmax(permute=False), safety_net=SafetyNet(rescue_lr_factor=0.25)))
    controller.initial_lrs = [0.1, 0.2, 0.4]  # (the callback sets them when fit starts)

    def vote(losses, multipliers, step, lr):
        interval = _interval(losses, multipliers=multipliers, step=step, lr=lr)
        return controller.decide(replace(interval, explored=Explored(lr=False)))

    first = vote([1.0, 1.0, 50.0], (1.0, 2.0, 4.0), 4, 0.1)
    second = vote([0.9, 60.0, 0.9], first.multipliers[:, 0].tolist(), 8, 0.05)
    vote([0.8, 0.85, 0.8], second.multipliers[:, 0].tolist(), 12, 0.05)
    trained = {step: [r["trained_lr"] for r in _rows(controller, step)] for step in (4, 8, 12)}
    set_lrs = {step: [r["lr"] for r in _rows(controller, step)] for step in (4, 8, 12)}
    assert trained[4] == pytest.approx([0.1, 0.2, 0.4])  # the initial LRs
    assert set_lrs[4] == pytest.approx([0.1, 0.2, 0.1])  # group 2 diverged: cut to a quarter
    assert trained[8] == pytest.approx([0.1, 0.2, 0.1])  # what vote 1 set: the interval's first step's LRs
    assert set_lrs[8] == pytest.approx([0.05, 0.025, 0.05])  # (1, 2, 1) at the halved schedule; group 1 diverged
    assert trained[12] == pytest.approx([0.05, 0.025, 0.05]) == set_lrs[12]
    assert [r["loss"] for r in _rows(controller, 8)] == [0.9, 60.0, 0.9]


def test_history_rows_say_what_each_explored_hyperparameter_was_and_became():
    table = torch.tensor([[1.0], [4.0]], dtype=torch.float64)
    explored = Explored(tables={"weight_decay": table}, bases={"weight_decay": [0.01]})
    controller = HDETController(HDETConfig(vote=Softmax(permute=False, meta_lr=1.0)))
    decision = controller.decide(replace(_interval([2.0, 1.0], multipliers=(1.0, 1.0)), explored=explored))
    rows = controller.history
    assert [r["trained_explored"]["weight_decay"] for r in rows] == pytest.approx([0.01, 0.04])
    assert [r["explored"]["weight_decay"] for r in rows] == decision.values["weight_decay"] != [0.01, 0.04]
    moved = replace(explored, tables=decision.explored)
    controller.decide(replace(_interval([2.0, 1.0], multipliers=(1.0, 1.0), step=8), explored=moved))
    assert [r["trained_explored"]["weight_decay"] for r in controller.history[2:]] == decision.values["weight_decay"]
    assert all(math.isnan(r["trained_lr"]) for r in rows[:2])  # no initial_lrs given: unknown


def test_an_older_checkpoints_history_loads_with_trained_lr_filled_from_the_vote_before():
    controller = HDETController(HDETConfig(vote=Softmax(permute=False)))
    first = controller.decide(_interval([2.0, 1.0], step=4))
    second = controller.decide(_interval([1.8, 1.0], multipliers=first.multipliers[:, 0].tolist(), step=8))
    state = controller.state_dict()
    state["history"] = [{k: v for k, v in row.items() if k != "trained_lr"} for row in state["history"]]
    resumed = HDETController(HDETConfig(vote=Softmax(permute=False)))
    resumed.load_state_dict(state)
    assert all(math.isnan(row["trained_lr"]) for row in resumed.history[:2])  # the initial LRs were not kept
    assert [row["trained_lr"] for row in resumed.history[2:]] == first.lrs
    assert [row["lr"] for row in resumed.history] == first.lrs + second.lrs
    resumed.decide(_interval([1.5, 1.0], multipliers=second.multipliers[:, 0].tolist(), step=12))
    assert [row["trained_lr"] for row in resumed.history[4:]] == second.lrs
