"""The controller with the PBT vote, a signal's scores and the collapse rules, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from dataclasses import dataclass

from lightning_hdet import PBT, Best, HDETCallback, SafetyNet, Search, Softmax
from lightning_hdet.hdet.rules.options import Signal
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.selection import MergeStep
from lightning_hdet.hdet.rules.signals import LossCurve


def _interval(losses, multipliers, step=4, final=False, curves=None, first=None, finite=None):
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    finite = [True] * len(losses) if finite is None else finite
    return Interval(step, losses, finite, table, [0.1], False, final, curves, first)


def test_pbt_decision_copies_the_best_into_the_worst_only():
    controller = HDETController(HDETConfig(vote=PBT(resample_probability=0.0)))
    decision = controller.decide(_interval([3.0, 1.0, 2.0, 4.0], (0.5, 1.0, 2.0, 4.0)))
    assert decision.plan == [MergeStep([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])] and decision.coefficients == []
    assert decision.multipliers[:3, 0].tolist() == [0.5, 1.0, 2.0]
    assert round(float(decision.multipliers[3, 0]), 9) in (0.8, 1.2)
    assert controller.finishing_merge() == ([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])  # ends on the winner
    final = controller.decide(_interval([3.0, 1.0, 2.0, 4.0], (0.5, 1.0, 2.0, 4.0), final=True))
    assert final.plan == [MergeStep([0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0])]


@dataclass(frozen=True)
class _Slope(Signal):
    """A signal of the test's own: the last bin's mean loss minus the first's (the steeper fall scores lower)."""

    name = "slope"

    def scores(self, interval, every):
        rows = interval.curves.tolist()
        return [r[7] / r[15] - r[0] / r[8] for r in rows]


def test_a_signals_scores_decide_the_vote_and_the_final_merge_picks_by_level():
    curves = []
    for start, fall in ((1.0, 0.1), (1.3, 0.6)):  # group 0: the lower mean; group 1: falls six times as fast
        curve = LossCurve(16, 8)
        for t in range(16):
            curve.add(t, torch.tensor(start - fall * t / 15))
        curves.append(curve.row())
    curves = torch.stack(curves)
    means = [float(r[:8].sum() / r[8:].sum()) for r in curves]  # 1 - 0.1 / 2 = 0.95 and 1.3 - 0.6 / 2 = 1.0
    assert means[0] < means[1]
    mean_vote = HDETController(HDETConfig(every_n_steps=16, vote=Best(blend="best")))
    assert mean_vote.decide(_interval(means, (1.0, 2.0), curves=curves)).winner == 0
    sloped = HDETController(HDETConfig(every_n_steps=16, vote=Best(blend="best"), signal=_Slope()))
    decision = sloped.decide(_interval(means, (1.0, 2.0), curves=curves))
    assert decision.winner == 1 and decision.coefficients == [0.0, 1.0] and decision.losses == means
    assert sloped.decide(_interval(means, (1.0, 2.0), curves=curves, final=True)).winner == 0


def test_collapsed_groups_roll_back_with_cut_lrs_and_no_good_merge():
    controller = HDETController(HDETConfig(vote=Softmax(permute=False, meta_lr=0.0), safety_net=SafetyNet(stall_patience=1)))
    first = controller.decide(_interval([2.4, 2.5], (1.0, 2.0), first=[2.3, 2.3]))
    assert not first.roll_back and not first.keep  # nobody below its first step's loss: not a roll-back point
    second = controller.decide(_interval([2.35, 2.4], (1.0, 2.0), step=8))
    assert second.roll_back and second.reasons == ["stalled", "stalled"] and second.plan == []
    assert second.multipliers[:, 0].tolist() == [0.5, 1.0]
    third = controller.decide(_interval([1.5, 1.9], (0.5, 1.0), step=12))
    assert not third.roll_back and third.keep and third.reasons == ["", ""]
    assert controller.collapse_history.start == [2.3, 2.3]
    assert [h["reason"] for h in controller.history[2:4]] == ["stalled", "stalled"]


def test_constant_predictor_and_rise_rules_rescue_one_group():
    controller = HDETController(HDETConfig(vote=Softmax(permute=False, meta_lr=0.0),
                                           safety_net=SafetyNet(chance_loss=math.log(10), rise_margin=1.0)))
    decision = controller.decide(_interval([2.25, 1.0], (1.0, 2.0)))  # 2.25 >= 0.95 ln 10 = 2.187
    assert decision.rescued == [True, False] and decision.reasons == ["chance", ""]
    assert decision.coefficients == [0.0, 1.0] and decision.multipliers[:, 0].tolist() == [0.5, 2.0]
    rose = controller.decide(_interval([1.0, 2.1], (0.5, 2.0), step=8))  # 2.1 > (1 + 1.0) x 1.0
    assert rose.reasons == ["", "rose"] and not rose.roll_back


def test_collapse_rules_are_on_by_default_but_do_not_judge_progress_at_the_final_merge():
    """Start 1.0 (no noise given); the interval at 0.5 halves it. 2.0 four times that, every group above its start
    after learning: a relapse of the ensemble, except in the final merge's interval (often a fragment of a few
    steps), where only non-finite and x-best groups are kept out."""
    config = HDETConfig(vote=Softmax(permute=False, meta_lr=0.0))
    assert (config.safety_net.stall_patience, config.safety_net.rise_margin) == (2, 1.0)
    for final, reasons in ((False, ["relapsed", "relapsed"]), (True, ["", ""])):
        controller = HDETController(config)
        controller.decide(_interval([0.5, 0.5], (1.0, 2.0), first=[1.0, 1.0]))
        assert controller.decide(_interval([2.0, 2.0], (1.0, 2.0), step=8, final=final)).reasons == reasons
    controller = HDETController(config)
    controller.decide(_interval([0.5, 0.5], (1.0, 2.0), first=[1.0, 1.0]))
    final = controller.decide(_interval([0.5, math.nan], (1.0, 2.0), step=8, final=True))
    assert final.reasons == ["", "non-finite"] and final.coefficients == [1.0, 0.0]


def test_safety_net_off_judges_nothing_and_keeps_every_finite_merge():
    controller = HDETController(HDETConfig(safety_net=None))
    decision = controller.decide(_interval([5.0, 5.0], (1.0, 2.0), first=[1.0, 1.0]))
    assert decision.rescued == [False, False] and decision.keep


@pytest.mark.parametrize(("make", "match"), [
    (lambda: PBT(quantile=0.9), r"`quantile` must be a number in \(0, 0.5\]"),
    (lambda: HDETCallback(signal="slope"), "`signal` must be 'mean' or a Signal object"),
    (lambda: HDETCallback(signal=_Slope(), monitor="val_loss"), "`signal` must be 'mean' when `monitor` is set"),
    (lambda: HDETCallback(monitor="val_loss", search=Search(evidence=2.0)), "`search` must be a Search without "
     r"`evidence` when the votes read `monitor` \(got monitor='val_loss'\).*drop `evidence`, or pass monitor=None"),
    (lambda: SafetyNet(stall_patience=0), "`stall_patience` must be a positive integer or None"),
    (lambda: SafetyNet(rise_margin=0), "`rise_margin` must be a finite number > 0 or None"),
    (lambda: SafetyNet(chance_loss=float("nan")), "`chance_loss` must be a finite number or None"),
])
def test_callback_rejects_bad_rule_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _noisy_curves(levels, noise: float, interval: int = 16) -> torch.Tensor:
    """Flat curves at ``levels`` whose bin means (two steps each, eight bins) alternate -``noise``, +``noise``."""
    rows = []
    for level in levels:
        curve = LossCurve(interval, 8)
        for t in range(interval):
            curve.add(t, torch.tensor(level + (noise if (t // 2) % 2 else -noise)))
        rows.append(curve.row())
    return torch.stack(rows)


def test_each_vote_records_where_its_winner_stood_and_whether_it_led_beyond_noise():
    """``edge``: the winner's LR the highest (1), the lowest (-1) or inside (0) of those voted on; ``clear``: the
    winner led the runner-up by more than two standard errors of the difference (bin means +-0.1 about the level:
    each group's error sqrt(8 * 0.01 / 7 / 8) = 0.0378, the difference's 0.0535, two of them 0.107)."""
    error = math.sqrt(8 * 0.01 / 7 / 8)
    assert 2 * math.hypot(error, error) == pytest.approx(0.1069, abs=1e-4)
    controller = HDETController(HDETConfig(vote=PBT(resample_probability=0.0)))
    top = controller.decide(_interval([2.0, 1.5, 1.0], (0.5, 1.0, 2.0), curves=_noisy_curves([2.0, 1.5, 1.0], 0.1)))
    assert top.winner == 2 and {(h["edge"], h["clear"]) for h in controller.history} == {(1, 1)}
    inside = controller.decide(_interval([1.2, 1.15, 1.3], (0.5, 1.0, 2.0), curves=_noisy_curves([1.2, 1.15, 1.3],
                                                                                                 0.1)))
    assert inside.winner == 1 and (controller.history[-1]["edge"], controller.history[-1]["clear"]) == (0, 0)
    controller.decide(_interval([1.0, 1.5], (0.5, 1.0)))  # no curves (e.g. monitor): the lead is not judged
    assert (controller.history[-1]["edge"], controller.history[-1]["clear"]) == (-1, "")


def test_a_vote_on_which_no_group_learned_travels_the_way_the_losses_name():
    """First step 1.78: every group inside its 2 % band (1.7444 .. 1.8156), none ever above it, nothing caught:
    every LR too low, the worst two (1, 2) probe one and two spacings above the highest LR (27 ** 0.75, 27). Every
    group above the band (they blew up): every LR too high, the worst two (3, 1) probe below the lowest
    (27 ** -0.5, 27 ** -0.75) and restart from the initial model. One group above the band beside flat ones: only
    its LR is too high, an ordinary vote (the worst, 3, copies the noise winner x0.8). One group below the band
    (1.70: it learned): an ordinary vote, the worst (1) copies the winner (3) x1.2. All inside the search: without
    one, ties are an ordinary vote."""
    grid = (27 ** -0.25, 1.0, 27 ** 0.25, 27 ** 0.5)

    def decided(losses, search=Search(steps=100)):
        controller = HDETController(HDETConfig(vote=PBT(resample_probability=0.0, factors=(0.8, 0.8)),
                                               search=search))
        return controller.decide(_interval(losses, grid, first=[1.78] * 4))

    up = decided([1.795, 1.799, 1.797, 1.796])
    assert up.multipliers[:, 0].tolist() == pytest.approx([grid[0], 27 ** 0.75, 27.0, grid[3]]) and not up.from_initial
    down = decided([1.83, 1.95, 1.84, 2.4])
    assert down.multipliers[:, 0].tolist() == pytest.approx([grid[0], 27 ** -0.5, grid[2], 27 ** -0.75])
    assert down.from_initial == [False, True, False, True]
    one = decided([1.795, 1.799, 1.797, 1.9])
    assert one.multipliers[:, 0].tolist() == pytest.approx([grid[0], grid[1], grid[2], 27 ** -0.25 * 0.8])
    learned = decided([1.795, 1.799, 1.797, 1.70])
    assert learned.multipliers[:, 0].tolist() == pytest.approx([grid[0], 27 ** 0.5 * 1.2, grid[2], grid[3]])
    # No search (or after it ended): ties are an ordinary vote, the worst (1) copies the noise winner (0) x0.8.
    plain = decided([1.795, 1.799, 1.797, 1.796], search=None)
    assert plain.multipliers[:, 0].tolist() == pytest.approx([grid[0], 27 ** -0.25 * 0.8, grid[2], grid[3]])


def test_a_training_loss_that_rose_blocks_the_upward_travel_of_a_monitored_vote():
    """Votes on a monitored metric: the validation losses are ties inside the band, but group 3's training-loss
    curve peaked above it (3.0 in its first bin: a blow-up the validation no longer shows) — that group rose, so
    every later flat vote stays an ordinary one (no upward travel), here and at the next vote."""
    grid = (27 ** -0.25, 1.0, 27 ** 0.25, 27 ** 0.5)
    curves = []
    for g in range(4):
        curve = LossCurve(8, 8)
        for t in range(8):
            curve.add(t, torch.tensor(3.0 if g == 3 and t == 0 else 1.79))
        curves.append(curve.row())
    controller = HDETController(HDETConfig(vote=PBT(resample_probability=0.0, factors=(0.8, 0.8)), monitor="val_loss",
                                           search=Search(steps=100)))
    first = controller.decide(_interval([1.795, 1.799, 1.797, 1.796], grid, curves=torch.stack(curves), first=[1.78] * 4))
    assert controller.rose_seen and max(first.multipliers[:, 0].tolist()) == pytest.approx(grid[3])
    flat = controller.decide(_interval([1.795, 1.799, 1.797, 1.796], grid, step=8))
    assert max(flat.multipliers[:, 0].tolist()) == pytest.approx(grid[3])
    assert "rose_seen" not in HDETController(HDETConfig()).state_dict()  # (as in checkpoints from before it)
    resumed = HDETController(HDETConfig(vote=PBT(resample_probability=0.0, factors=(0.8, 0.8)), monitor="val_loss"))
    resumed.load_state_dict(controller.state_dict())
    assert resumed.rose_seen
