"""After the whole ensemble relapses to its untrained loss: the roll-back's grid at and below the LR that made the
roll-back point, and the ceiling no later vote may climb to (lightning_hdet/hdet/rules/relapse.py): by hand in one
process, through the controller, then over a FakeWorld whose model collapses above a critical LR."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet import HDETCallback
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.relapse import RelapseMemory, after_relapse, capped
from lightning_hdet.testing import FakeWorld

pytestmark = pytest.mark.timeout(60)


def _table(*columns):
    return torch.tensor(list(zip(*columns)), dtype=torch.float64)


def test_the_grid_after_a_relapse_starts_at_the_good_lr_or_one_step_below_the_lowest_lr_that_relapsed():
    """Issue 59's seed 0 (SGD, the CNN, good LR 0.046): the roll-back point was made at 0.1926, the groups relapsed
    at 0.2312, 0.2312, 0.1284 and 0.1926 (multipliers of a schedule LR of 0.046). Ceiling 0.1284; one step (1.5)
    below it 0.0856 < 0.1926, so the grid is 0.0856, 0.0571, 0.0380, 0.0254, the highest rung to the group that had
    the highest LR (ties: the lower index). A second param group at schedule LR 0.01 (ceiling 0.006, its step
    0.004) with a good LR of 0.003 starts at 0.003, handed out in that column's order (groups 0, 3, 1, 2)."""
    memory = RelapseMemory(good=[0.1926, 0.003])
    table = _table([0.2312 / 0.046, 0.2312 / 0.046, 0.1284 / 0.046, 0.1926 / 0.046], [1.0, 0.8, 0.6, 0.9])
    new = after_relapse(memory, table, [0.046, 0.01], 1.5)
    assert memory.ceiling == pytest.approx([0.1284, 0.006])
    top = 0.1284 / 1.5
    assert (new[:, 0] * 0.046).tolist() == pytest.approx([top, top / 1.5, top / 1.5**3, top / 1.5**2])
    assert (new[:, 1] * 0.01).tolist() == pytest.approx([0.003, 0.003 / 1.5**2, 0.003 / 1.5**3, 0.003 / 1.5])
    assert table[0, 0] == pytest.approx(0.2312 / 0.046)  # the input is left alone

    # A second relapse lowers the ceiling (never raises it): groups at 0.08 and 0.05 relapse -> 0.05.
    after_relapse(memory, _table([0.08 / 0.046, 0.05 / 0.046, 0.06 / 0.046, 0.07 / 0.046], [0.5] * 4), [0.046, 0.01],
                  1.5)
    assert memory.ceiling == pytest.approx([0.05, 0.005])


def test_the_ceiling_caps_every_later_lr_one_step_below_it_and_follows_the_schedule():
    """Ceiling 0.09 (real LR), step 1.5: a real LR may be at most 0.06. At a schedule LR of 0.03 a multiplier may be
    at most 2; at 0.015 (a decayed schedule) at most 4. Without a ceiling (or a stale one of another width) the
    table is returned as it is."""
    memory = RelapseMemory(ceiling=[0.09])
    table = _table([1.0, 1.5, 2.5, 3.0])
    assert capped(memory, table, [0.03], 1.5)[:, 0].tolist() == pytest.approx([1.0, 1.5, 2.0, 2.0])
    assert capped(memory, table, [0.015], 1.5)[:, 0].tolist() == pytest.approx([1.0, 1.5, 2.5, 3.0])
    assert capped(RelapseMemory(), table, [0.03], 1.5) is table
    state = memory.state_dict()
    restored = RelapseMemory()
    restored.load_state_dict(state)
    assert restored == memory


def _interval(step, losses, multipliers, first=None):
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    first_errors = [0.005] * len(losses) if first is not None else None
    return Interval(step, losses, [True] * len(losses), table, [0.046], False, False, None, first, first_errors)


def test_the_controller_rolls_a_relapsed_ensemble_back_below_the_lrs_that_relapsed_and_keeps_them_there():
    """Four groups start at 1.79 (ln 6); votes at 30 and 60 learn (1.60 and below: kept, the roll-back point's
    winner is remembered); at 90 every group is back within 2 % of 1.79 (one at 1.76, below the old rule's band
    edge): all relapsed, a roll-back, the grid one step (1.5) below the lowest LR that relapsed or at the good LR.
    The vote after it may not move any LR above the ceiling's step; the checkpoint carries the memory."""
    controller = HDETController(HDETConfig(every_n_steps=30))
    multipliers = [1.0, 1.5, 2.25, 3.375]
    first = controller.decide(_interval(30, [1.70, 1.65, 1.62, 1.60], multipliers, first=[1.79] * 4))
    assert first.keep and not first.roll_back
    multipliers = first.multipliers[:, 0].tolist()
    second = controller.decide(_interval(60, [1.50, 1.45, 1.40, 1.35], multipliers))
    assert second.keep and not second.roll_back
    good = multipliers[second.winner] * 0.046
    assert controller.relapse.good == pytest.approx([good])
    relapsed_at = second.multipliers[:, 0].tolist()
    third = controller.decide(_interval(90, [1.76, 1.80, 1.79, 1.82], relapsed_at))
    assert third.roll_back and third.reasons == ["relapsed"] * 4 and all(third.rescued)
    ceiling = min(relapsed_at) * 0.046
    assert controller.relapse.ceiling == pytest.approx([ceiling])
    top = min(good, ceiling / 1.5)
    assert sorted(third.lrs, reverse=True) == pytest.approx([top / 1.5**k for k in range(4)])
    for step in (120, 150, 180):  # the highest group keeps winning: the vote would move the LRs up
        decision = controller.decide(_interval(step, [1.5, 1.45, 1.4, 1.2 - step / 1000],
                                               [third.lrs[g] / 0.046 for g in range(4)]))
        assert max(decision.lrs) <= ceiling / 1.5 * (1 + 1e-9)
    resumed = HDETController(HDETConfig(every_n_steps=30))
    resumed.load_state_dict(controller.state_dict())
    assert resumed.relapse == controller.relapse


L0 = math.log(6)  # the untrained (and the collapsed) model's loss
CRITICAL = 0.12  # above this LR the model collapses to chance from step COLLAPSE_AT on
COLLAPSE_AT = 30


def _collapses_above_critical(executor, index):
    """A model ``(x, dead)``: loss ``L0 x^2`` while alive, ``L0`` dead (no gradient: it never learns again). Each
    step moves ``x <- x (1 - lr / 10)``, so a higher LR learns faster, until from step ``COLLAPSE_AT`` on any LR
    above ``CRITICAL`` kills the model before its step (a CNN with SGD above 2-3x its good LR: issue 59). A merge of
    dead and alive models is dead from half on."""
    lr = float(executor.current_lrs()[executor.group_index, 0])
    if index >= COLLAPSE_AT and lr > CRITICAL:
        executor.params[1] = 1.0
    if executor.params[1] >= 0.5:
        return L0
    x = float(executor.params[0])
    executor.params[0] = x * (1 - lr / 10)
    return L0 * x**2


def test_a_relapsed_ensemble_trains_on_below_the_lr_that_collapsed_and_never_climbs_back():
    """Four groups at 0.10-0.17: they learn (the loss from 1.79 to about 0.7 by step 30; PBT moves them to 0.17-0.30,
    every one above the critical LR 0.12) and all collapse at step 30, so the vote at 40 finds every group back at
    1.79: one roll-back (to the merge kept at 30) onto 0.1728 / 1.5 = 0.1152 (one step below the lowest LR that
    relapsed, below the winner's 0.2488 that made the merge) and three rungs below it. The votes after it favour
    the highest LR (it learns fastest) and PBT walks it up; the ceiling stops every LR one step below the LR that
    relapsed to the end, so the model never collapses again and ends far below the untrained loss. (Without the
    ceiling PBT climbs past 0.12 and the ensemble collapses again.)"""
    world = FakeWorld(params=[1.0, 0.0], lr_multipliers=[1.0, 1.2, 1.44, 1.728], schedule_lrs=[0.1])
    ((cb, _), *_) = world.fit(lambda: HDETCallback(every_n_steps=10, search=False), _collapses_above_critical,
                              max_steps=200)
    history = cb.history
    steps = sorted({h["step"] for h in history})
    roll_backs = [s for s in steps if all(h["rescued"] for h in history if h["step"] == s)]
    assert roll_backs == [40] and {h["reason"] for h in history if h["step"] == 40} == {"relapsed"}
    relapsed_at = min(h["lr"] for h in history if h["step"] == 30)  # the LRs of steps 30-39
    assert relapsed_at / 1.5 < CRITICAL < relapsed_at
    after = [h["lr"] for h in history if h["step"] >= 40]
    assert max(after) == pytest.approx(relapsed_at / 1.5)  # the votes pushed up to the ceiling's step, not past it
    assert all(float(world.params[g, 1]) < 0.5 for g in range(4))
    assert max(h["loss"] for h in history if h["step"] == 200) < 0.1 * L0
