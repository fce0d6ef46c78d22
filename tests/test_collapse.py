"""Collapse detection: each rule against hand-computed losses, the history it keeps, and the good-merge test."""

from __future__ import annotations

import math

import pytest

from lightning_hdet.hdet.rules.collapse import (
    CollapseHistory,
    Verdict,
    advance,
    is_good,
    judge,
    none_progressed,
    restarted,
    risen,
    rose_above_start,
)
from lightning_hdet.hdet.rules.safety_net import SafetyNet

OK = [True, True, True]


def test_non_finite_and_worse_than_best():
    verdict = judge(SafetyNet(), CollapseHistory(), [1.0, 20.0, math.nan], OK)
    assert verdict.reasons == ["", "x best", "non-finite"] and verdict.diverged == [False, True, True]
    verdict = judge(SafetyNet(divergence_factor=None), CollapseHistory(), [1.0, 20.0, 3.0], [True, True, False])
    assert verdict.reasons == ["", "", "non-finite"]  # a group that skipped a step is caught whatever its loss


def test_a_group_stuck_at_its_starting_level_is_caught_after_patience_votes():
    rule = SafetyNet(stall_patience=2)
    history = CollapseHistory()
    verdict = judge(rule, history, [3.0, 3.0], [True, True])  # first vote: nothing to compare with yet
    assert verdict.reasons == ["", ""]
    history = advance(history, verdict, [3.0, 3.0], rolled_back=False, first=[5.5, 5.5])
    assert history.start == [5.5, 5.5] and history.previous == [3.0, 3.0]
    verdict = judge(rule, history, [2.0, 6.1], [True, True])
    assert verdict.reasons == ["", "rose"] and verdict.stalled == [0, 1]  # 6.1 > 2 x 3.0 rose; stalled 1 of 2
    history = advance(history, Verdict([False, False], ["", ""], verdict.stalled), [2.0, 6.1], rolled_back=False)
    verdict = judge(rule, history, [1.5, 5.5], [True, True])
    assert verdict.reasons == ["", "stalled"] and verdict.stalled == [0, 2]
    loose = SafetyNet(stall_patience=1, stall_tolerance=0.05)  # 5.3 >= 0.95 * 5.5 = 5.225
    assert judge(loose, history, [1.5, 5.3], [True, True]).reasons == ["", "stalled"]
    assert judge(rule, history, [1.5, 5.5], [True, True], progress=False).reasons == ["", ""]


def test_rise_over_own_previous_interval():
    history = CollapseHistory([10.0, 10.0], [1.0, 1.0], [0, 0])
    assert judge(SafetyNet(rise_margin=1.0), history, [2.0, 2.01], [True, True]).reasons == ["", "rose"]
    assert judge(SafetyNet(rise_margin=None), history, [2.0, 2.01], [True, True]).reasons == ["", ""]


def test_constant_predictor_level():
    rule = SafetyNet(chance_loss=math.log(256), chance_tolerance=0.05)  # 0.95 * 5.545 = 5.268
    verdict = judge(rule, CollapseHistory(), [5.30, 5.20, 7.0], OK)
    assert verdict.reasons == ["chance", "", "chance"]
    assert not verdict.all_diverged and judge(rule, CollapseHistory(), [5.3, 5.4, 5.5], OK).all_diverged


def test_advance_forgets_after_a_rescue_or_a_roll_back():
    history = CollapseHistory([5.0, math.nan, 5.0], [2.0, 2.0, 2.0], [1, 1, 1])
    verdict = Verdict([False, False, True], ["", "", "non-finite"], [1, 1, 1])
    after = advance(history, verdict, [1.5, 4.0, math.nan], rolled_back=False, first=[9.0, 4.0, 9.0])
    assert after.start == [5.0, 4.0, 5.0]  # set once, from the first step's loss
    assert math.isnan(advance(history, verdict, [1.5, 4.0, 1.0], rolled_back=False).start[1])  # unknown: no rule
    assert after.previous[:2] == [1.5, 4.0] and math.isnan(after.previous[2]) and after.stalled == [1, 1, 0]
    rolled = advance(history, verdict, [1.5, 4.0, math.nan], rolled_back=True)
    assert all(math.isnan(p) for p in rolled.previous) and rolled.stalled == [0, 0, 0]


def test_good_merge_needs_every_kept_group_below_its_start():
    rule = SafetyNet()
    history = CollapseHistory([3.0, 3.0], [math.nan, math.nan], [0, 0])
    fine = Verdict([False, False], ["", ""], [0, 0])
    assert is_good(rule, fine, [2.0, 2.5], history)
    assert not is_good(rule, fine, [2.0, 3.0], history)
    assert is_good(rule, Verdict([False, True], ["", "rose"], [0, 0]), [2.0, 9.0], history)
    assert not is_good(rule, Verdict([True, True], ["x", "x"], [0, 0]), [2.0, 2.0], history)
    assert is_good(rule, fine, [2.0, 2.0], CollapseHistory())  # no starting level known: any finite merge is


def test_history_state_round_trip_and_resize():
    history = CollapseHistory([5.0, 4.0], [1.0, math.nan], [0, 2])
    other = CollapseHistory()
    other.load_state_dict(history.state_dict())
    assert other.start == [5.0, 4.0] and other.stalled == [0, 2] and math.isnan(other.previous[1])
    fresh = history.sized(3)
    assert len(fresh.start) == 3 and all(math.isnan(s) for s in fresh.start)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"divergence_factor": 1.0}, "`divergence_factor` must be None or a finite number > 1"),
    ({"stall_patience": 0}, "`stall_patience` must be a positive integer or None"),
    ({"rise_margin": -0.5}, "`rise_margin` must be a finite number > 0 or None"),
    ({"chance_loss": math.inf}, "`chance_loss` must be a finite number or None"),
    ({"chance_tolerance": 1.0}, r"`chance_tolerance` must be a number in \[0, 1\)"),
    ({"stall_tolerance": -0.1}, r"`stall_tolerance` must be a number in \[0, 1\)"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SafetyNet(**kwargs)


# ------------------------------------------------------------------ noise (the rules safe to be on by default)
def test_rise_must_exceed_the_interval_noise():
    """Previous interval 1.0. This one averages 3.0 with standard error 0.6: 3.0 - 2 x 0.6 = 1.8 is not above
    2 x 1.0, so one noisy step does not count as a rise; with standard error 0.4, 3.0 - 0.8 = 2.2 > 2.0 does."""
    history = CollapseHistory([10.0], [1.0], [0], [0.0], [True])
    assert judge(SafetyNet(rise_margin=1.0), history, [3.0], [True], errors=[0.6]).reasons == [""]
    assert judge(SafetyNet(rise_margin=1.0), history, [3.0], [True], errors=[0.4]).reasons == ["rose"]


def test_stall_needs_the_loss_above_the_starting_levels_noise_band():
    """Start 1.0 with standard error 0.1: the band is 1.0 +- 0.2. A loss of 1.1 is inside it (no stall, and the
    group has not left its start); 1.3 is above it (left, and at the start level: one stalled vote)."""
    rule = SafetyNet(stall_patience=1)
    fresh = CollapseHistory([1.0], [math.nan], [0], [0.1], [False])
    assert judge(rule, fresh, [1.1], [True]).stalled == [0]
    assert judge(rule, fresh, [1.3], [True]).reasons == ["stalled"]


def test_a_plateau_at_the_starting_level_is_not_a_collapse_until_the_loss_left_it():
    """A group that never left its start's band (a plateau before learning starts) is not stalled, however long;
    once it has been outside the band (here below: it learned), coming back above the band counts."""
    rule = SafetyNet(stall_patience=2, rise_margin=None)  # the stall rule alone (0.5 -> 1.25 would also be a rise)
    history = CollapseHistory([1.0], [math.nan], [0], [0.1], [False])
    for loss in (1.15, 1.19, 1.15):  # inside 1.0 + 2 x 0.1, never left: the upper bound 1.2 is not reached
        verdict = judge(rule, history, [loss], [True])
        assert verdict.reasons == [""] and verdict.stalled == [0]
        history = advance(history, verdict, [loss], rolled_back=False)
    assert history.left == [False]
    verdict = judge(rule, history, [0.5], [True])  # learned: left the band below
    history = advance(history, verdict, [0.5], rolled_back=False)
    assert history.left == [True]
    for expected in (1, 2):  # back above the band twice: stalled after `patience` votes
        verdict = judge(rule, history, [1.25], [True])
        assert verdict.stalled == [expected]
        history = advance(history, verdict, [1.25], rolled_back=False)
    assert verdict.reasons == ["stalled"]
    assert advance(history, verdict, [1.25], rolled_back=True).left == [False]  # a roll-back forgets it


def test_the_starting_level_and_its_error_are_set_once_from_the_first_vote():
    verdict = Verdict([False], [""], [0])
    history = advance(CollapseHistory(), verdict, [2.0], rolled_back=False, first=[2.5], first_error=[0.05])
    assert history.start == [2.5] and history.start_error == [0.05] and history.left == [True]  # 2.0 < 2.4
    later = advance(history, verdict, [2.0], rolled_back=False, first=[9.0], first_error=[1.0])
    assert later.start == [2.5] and later.start_error == [0.05]
    old = CollapseHistory()
    old.load_state_dict({"start": [2.5], "previous": [2.0], "stalled": [1]})  # a checkpoint before the noise rule
    assert old.sized(1).start_error == [0.0] and old.sized(1).left == [True]


def test_an_ensemble_back_at_its_untrained_loss_counts_as_relapsed_at_once():
    """Issue 59's CNN with SGD: every group had learned (previous intervals 1.44-1.52 against a start of 1.79) and
    fell back to about ln(6) in one interval, a rise of 25 %, never a doubling. Start 1.79 +- 2 x 0.005: the band's
    lower edge 1.78, the level band's (2 %) 1.7542. The lowest previous interval (1.439) is below 0.9 x 1.78 = 1.602
    and every loss at or above 1.7542: all relapsed, also with one group at 1.76 (below the band's edge: a collapsed
    CNN's validation loss sits within 1 % of ln 6 either side) and with another's previous interval at 1.65 (the
    groups share their models). One group still below 1.7542, or no previous interval below 1.602, and no group
    counts."""
    history = CollapseHistory([1.79] * 4, [1.454, 1.518, 1.466, 1.439], [0] * 4, [0.005] * 4, [True] * 4)
    assert judge(SafetyNet(), history, [1.878, 1.868, 1.797, 1.827], [True] * 4).reasons == ["relapsed"] * 4
    assert judge(SafetyNet(), history, [1.878, 1.868, 1.797, 1.76], [True] * 4).reasons == ["relapsed"] * 4
    assert judge(SafetyNet(), history, [1.878, 1.868, 1.797, 1.75], [True] * 4).reasons == [""] * 4
    wobbled = CollapseHistory([1.79] * 4, [1.454, 1.518, 1.65, 1.439], [0] * 4, [0.005] * 4, [True] * 4)
    assert judge(SafetyNet(), wobbled, [1.878, 1.868, 1.797, 1.827], [True] * 4).reasons == ["relapsed"] * 4
    shallow = CollapseHistory([1.79] * 4, [1.65, 1.62, 1.61, 1.70], [0] * 4, [0.005] * 4, [True] * 4)
    assert judge(SafetyNet(), shallow, [1.878, 1.868, 1.797, 1.827], [True] * 4).reasons == [""] * 4  # 1.61 > 1.602
    fresh = CollapseHistory([1.79] * 4, [1.454, 1.518, math.nan, 1.439], [0] * 4, [0.005] * 4, [True] * 4)
    assert judge(SafetyNet(), fresh, [1.878, 1.868, 1.797, 1.827], [True] * 4).reasons == [""] * 4  # (restarted)
    noisy = judge(SafetyNet(), history, [1.80] * 4, [True] * 4, errors=[0.03, 0.0, 0.0, 0.0])
    assert noisy.reasons == [""] * 4  # 1.80 - 2 x 0.03 = 1.74 is below 1.7542: not believed yet
    assert judge(SafetyNet(rise_margin=None), history, [1.878] * 4, [True] * 4).reasons == [""] * 4
    assert judge(SafetyNet(), history, [1.878] * 4, [True] * 4, progress=False).reasons == [""] * 4


def test_a_loss_within_two_percent_of_its_start_has_not_left_it():
    """Issue 59's CNN with SGD 40x too low: the untrained model's validation loss sat at 1.798-1.805 against a first
    training batch of about 1.78 with a tiny error (every item's loss is about ln 6), outside two standard errors:
    the stall rule counted it as having left its start, then as stalled, and the plateau rule cut every LR 20-100x.
    The band is at least 2 % of the level either side: 1.78 +- 0.0356 = 1.7444 .. 1.8156."""
    rule = SafetyNet(stall_patience=1)
    history = CollapseHistory([1.78], [math.nan], [0], [0.001], [False])
    verdict = judge(rule, history, [1.805], [True])
    assert verdict.reasons == [""] and advance(history, verdict, [1.805], rolled_back=False).left == [False]
    assert judge(rule, history, [1.82], [True]).reasons == ["stalled"]  # knocked above the band: left, at start
    assert not rose_above_start(history, [1.805]) and rose_above_start(history, [1.82])
    wide = CollapseHistory([1.0], [math.nan], [0], [0.1], [False])  # 2 standard errors (0.2) beyond 2 %: they hold
    assert wide.level_band(0) == pytest.approx((0.8, 1.2))


def test_none_progressed_until_a_healthy_group_is_below_its_starting_band():
    """Start 1.78 +- 0.0356 (2 %): 1.75 has not progressed, 1.74 has; above the band is no progress either (a
    rise is the safety net's to judge). A caught group does not count; an unknown level or no healthy group says
    nothing (False)."""
    history = CollapseHistory([1.78] * 3, [math.nan] * 3, [0] * 3, [0.001] * 3, [False] * 3)
    assert none_progressed(history, [1.80, 1.75, 1.90], [True] * 3)
    assert not none_progressed(history, [1.80, 1.74, 1.79], [True] * 3)
    assert none_progressed(history, [1.80, 1.0, 1.79], [True, False, True])
    assert not none_progressed(CollapseHistory(), [1.8] * 3, [True] * 3)
    assert not none_progressed(history, [1.8] * 3, [False] * 3)


def test_risen_names_the_groups_above_their_band_and_a_restart_forgets_only_the_flagged_ones():
    """Start 1.78 +- 0.0356: 1.82 and NaN rose, 1.80 did not, an unknown level says nothing. Restarting group 1
    forgets its previous interval, stall count and departure; group 0 keeps them."""
    history = CollapseHistory([1.78, 1.78, 1.78, math.nan], [1.5, 1.6, 1.7, 1.7], [1, 1, 0, 0], [0.001] * 4,
                              [True, True, False, False])
    assert risen(history, [1.82, math.nan, 1.80, 9.0]) == [True, True, False, False]
    fresh = restarted(history, [False, True, False, False])
    assert fresh.previous[0] == 1.5 and math.isnan(fresh.previous[1]) and fresh.stalled == [1, 0, 0, 0]
    assert fresh.left == [True, False, False, False] and fresh.start[:3] == [1.78] * 3
