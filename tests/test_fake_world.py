"""HDETCallback's votes, merges, rescues, roll-backs and the search's end in one process, over
:class:`lightning_hdet.testing.FakeWorld` (every group's parameters as a row of one tensor), against values computed
by hand. The collectives themselves and the launchers are tested with several processes (test_callback.py,
test_strategy.py, test_spawn.py, test_hdet_fsdp.py)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet import PBT, Best, HDETCallback, SafetyNet, Search, Softmax
from lightning_hdet.experimental import PartialMerge
from lightning_hdet.testing import FakeWorld

pytestmark = pytest.mark.timeout(60)


def _drift(losses):
    """A training step: group ``g``'s parameter grows by ``g + 1`` and the step's loss is ``losses(g, step)``."""

    def step(executor, index):
        executor.params.add_(executor.group_index + 1)
        return losses(executor.group_index, index)

    return step


def _falling(g, step):
    """Every group starts at 2.0 and falls, group g by 0.1 (g + 1) per step: the highest index learns fastest."""
    return 2.0 - 0.1 * (g + 1) * step


def _callback(**kw):
    """One fresh callback per group, as every rank builds its own (no search unless asked)."""
    return lambda: HDETCallback(**{"search": False, **kw})


def test_softmax_moves_the_base_lr_and_every_group_lands_on_the_mean():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Softmax(temperature=1.0, momentum=0.5, meta_lr=1.0,
                                                                   permute=False)), _drift(_falling), max_steps=4)
    # interval means over steps 0-3: 2 - 0.1 (g + 1) * 1.5
    losses = [1.85, 1.7]
    assert [h["loss"] for h in cb.history] == pytest.approx(losses)
    w1 = math.exp(0.075) / (math.exp(0.075) + math.exp(-0.075))  # softmax((mean - L) / T), T = 1
    assert [h["weight"] for h in cb.history] == pytest.approx([1 - w1, w1])
    # the controller: delta = sum w lr - mean lr, velocity (1 - momentum) delta, base LR 0.15 -> 0.15 + meta_lr v
    delta = (1 - w1) * 0.1 + w1 * 0.2 - 0.15
    base = 0.15 + 0.5 * delta
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([base / 0.15, 2 * base / 0.15])
    # params 4 and 8 at the vote, both to the mean; the vote was good (below the start): the mean is the restore point
    assert world.params.flatten().tolist() == [6.0, 6.0]
    assert world.restore_point.tolist() == [6.0] and world.restarts == [0, 0]


def test_a_partial_weighted_merge_then_the_final_merge_at_full_strength():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    vote = PartialMerge(Softmax(blend="weighted", temperature=1.0, meta_lr=0.0, permute=False), strength=0.5)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=vote), _drift(_falling), max_steps=4)
    w1 = math.exp(0.075) / (math.exp(0.075) + math.exp(-0.075))
    target = (1 - w1) * 4 + w1 * 8
    after_vote = [0.5 * 4 + 0.5 * target, 0.5 * 8 + 0.5 * target]  # theta <- (1 - s) theta + s target
    final = (1 - w1) * after_vote[0] + w1 * after_vote[1]  # nothing trained since: the same weights, strength 1
    assert world.params.flatten().tolist() == pytest.approx([final, final])
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 2.0])  # meta_lr 0: no LR moved


def test_pbt_copies_the_best_group_into_the_worst_only():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0, 4.0], num_groups=4)
    callback = _callback(every_n_steps=4, vote=PBT(quantile=0.25, resample_probability=0.0))
    world.fit(callback, _drift(_falling), max_steps=5)  # votes at 4; the end of fit merges on the best group
    # at step 4 the params are 4, 8, 12, 16: group 0 (the worst) copied group 3 (the best), then each grew once more
    assert world.table.get(1)[1:, 0].tolist() == [2.0, 3.0, 4.0]
    assert float(world.table.get(1)[0, 0]) in (pytest.approx(0.8 * 4.0), pytest.approx(1.2 * 4.0))
    # final merge on the best group of steps 5 (group 3: 16 + 4 = 20): every group holds it
    assert world.params.flatten().tolist() == [20.0] * 4


def test_pbt_copy_step_by_hand():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0, 4.0], num_groups=4)
    seen = []

    def step(executor, index):
        if index == 4:
            seen.append((executor.group_index, float(executor.params)))
        return _drift(_falling)(executor, index)

    world.fit(_callback(every_n_steps=4, vote=PBT(quantile=0.25, resample_probability=0.0)), step, max_steps=5)
    assert sorted(seen) == [(0, 16.0), (1, 8.0), (2, 12.0), (3, 16.0)]  # the copy, before step 5 trained


def test_best_vote_gives_every_group_the_winners_model():
    world = FakeWorld(params=[0.0], lr_multipliers=[0.5, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Best(blend="best", shrink=0.5)), _drift(_falling),
                           max_steps=4)
    assert cb.history[0]["winner"] == 1
    assert world.params.flatten().tolist() == [8.0, 8.0]
    # the winner keeps its LR; the other is re-centred on it at exp(2 x half the log-range x shrink)
    spread = 0.5 * (math.log(2.0) - math.log(0.5)) / 2
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([2.0 * math.exp(2 * spread), 2.0])


def test_a_diverged_group_is_rescued_from_the_healthy_groups_mean():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0], num_groups=3)

    def step(executor, index):
        if executor.group_index == 2 and index == 2:
            executor.params.fill_(math.nan)  # a step that blew up: the guard flagged it
            world.skip(2)
            return math.nan
        return _drift(_falling)(executor, index)

    (cb, _), *_ = world.fit(_callback(every_n_steps=4, vote=Softmax(meta_lr=0.0, permute=False)), step, max_steps=4)
    assert [h["rescued"] for h in cb.history] == [False, False, True] and cb.rescues == 1
    assert world.params.flatten().tolist() == [6.0, 6.0, 6.0]  # the mean of 4 and 8; group 2 took it fully
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 2.0, 1.5])  # its LR halved (rescue_lr_factor)
    assert world.restarts == [0, 0, 1]  # and its optimizer state restarted


def test_every_group_diverged_rolls_back_to_the_last_good_merge_and_halves_every_lr():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)

    def step(executor, index):
        if index >= 2:
            executor.params.fill_(math.nan)
            return math.nan
        return _drift(_falling)(executor, index)

    (cb, _), _ = world.fit(_callback(every_n_steps=2, vote=Softmax(meta_lr=0.0, permute=False)), step, max_steps=4)
    # vote at 2: params 2 and 4 merged to 3, a good vote (both below the start): 3 became the restore point
    # vote at 4: both NaN, every group rolled back to 3 with a fresh optimizer state and half its LR
    assert [h["winner"] for h in cb.history] == [1, 1, -1, -1]
    assert world.params.flatten().tolist() == [3.0, 3.0]
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([0.5, 1.0]) and world.restarts == [1, 1]


def test_a_blown_up_loss_under_a_shared_gradient_rolls_every_group_back_and_cuts_only_its_lr():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2, gradient_sync="global")
    losses = lambda g, step: 1e6 if g == 1 else _falling(g, step)  # noqa: E731 - finite, 10^6 x the best
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Softmax(meta_lr=0.0, permute=False),
                                     safety_net=SafetyNet(stall_patience=None, rise_margin=None)),
                           _drift(losses), max_steps=4)
    assert [h["rescued"] for h in cb.history] == [False, True]
    assert world.params.flatten().tolist() == [0.0, 0.0]  # back to the start: nothing of the interval is kept
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 1.0]) and world.restarts == [1, 1]


def test_the_search_ends_on_the_winner_with_a_grid_around_its_lr_and_global_gradients():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2, gradient_sync="group")
    (cb, _), _ = world.fit(_callback(every_n_steps=2, search=Search(steps=2, refine_spread=2.0)), _drift(_falling),
                           max_steps=3)
    assert cb.controller.searched_at == 2 and world.gradient_sync == "global"
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([2.0 / 2**0.5, 2.0 * 2**0.5])
    assert world.restarts == [1, 1]  # every group's moments were gathered on another model
    # at 2 every group took the winner's model (4), then step 3 moved them by 1 and 2; the end of fit merges
    # on the best group (group 1: 6) under PBT
    assert world.params.flatten().tolist() == [6.0, 6.0]
    assert ("set_gradient_sync", "global") in world.calls


def test_the_fake_holds_every_rank_to_the_same_calls():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    with pytest.raises(AssertionError, match=r"group [01] called .*set_lr_multipliers.* while group [01] called"):
        world.run(lambda executor: executor.set_lr_multipliers([1.0, 2.0 + executor.group_index]))
    table = world.run(lambda executor: executor.gather_group_values(torch.tensor([1.0 + executor.group_index])))
    assert table[0].tolist() == [[1.0], [2.0]] and torch.equal(table[0], table[1])
