"""The plateau rule (a plateau that is not learning is a failure): hand-computed loss series, in one process."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lightning_hdet.hdet.rules.collapse import Verdict
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.options import SafetyNet
from lightning_hdet.hdet.rules.plateau import (
    PlateauHistory,
    PlateauRule,
    forget,
    from_initial,
    improved,
    judge_plateau,
    judged_at,
    ladder,
    memorising,
    patience,
)
from lightning_hdet.hdet.rules.signals import LossCurve

FINE = Verdict([False, False], ["", ""], [0, 0])


def _series(rule, losses_by_vote, every=50, errors=None, verdict=FINE):
    """Judge vote after vote (at steps every, 2 every, ...) as the controller does: each vote's PlateauVerdict."""
    history, out = PlateauHistory(), []
    for k, losses in enumerate(losses_by_vote, start=1):
        result = judge_plateau(rule, history, verdict, losses, step=k * every, errors=errors)
        history = forget(result.history, result.all_stuck)
        out.append(result)
    return out


def test_a_new_best_needs_the_noise_and_the_relative_gain():
    """Best 2.0, standard error 0.05, min_gain 1 %: a new best is below 2.0 - 2 x 0.05 - 0.02 = 1.88."""
    rule = PlateauRule()
    assert improved(rule, math.nan, 5.0, 0.0)  # the first finite loss always is
    assert improved(rule, 2.0, 1.879, 0.05) and not improved(rule, 2.0, 1.881, 0.05)
    assert improved(rule, 2.0, 1.979, 0.0) and not improved(rule, 2.0, 1.981, 0.0)
    assert not improved(rule, 2.0, math.nan, 0.0)


def test_a_learning_run_never_fires_however_slowly_it_learns():
    """The best group falls 1.5 % a vote (more than min_gain, 1 %): 40 votes of 50 steps (10 x the rule's
    200) without a single stuck step; the other group, flat, does not matter."""
    series = [[2.3 * 0.985**k, 2.3] for k in range(40)]
    verdicts = _series(PlateauRule(steps=200), series)
    assert not any(v.all_stuck for v in verdicts) and verdicts[-1].history.stuck_steps == 0


def test_a_slow_stretch_shorter_than_the_rule_is_not_a_plateau():
    """Flat for three votes (150 steps), then a new best: the count returns to 0 before reaching 200."""
    series = [[2.0, 2.1], [1.99, 2.1], [2.0, 2.05], [1.995, 2.0], [1.9, 2.0], [1.95, 1.97]]
    verdicts = _series(PlateauRule(steps=200), series)
    assert [v.history.stuck_steps for v in verdicts] == [0, 50, 100, 150, 0, 50]
    assert not any(v.all_stuck for v in verdicts)


def test_an_ensemble_stuck_at_the_priors_loss_fails_once_stuck_long_enough():
    """A blow-up in the first interval (33 nats), then 1.86 +- noise in both groups: 1.86 is the best (vote 2);
    no group gets below 1.86 - 2 x 0.01 - 0.0186 = 1.8214 in the 200 steps after it: at vote 6 every group fails
    (reason "plateau" where no other rule spoke), and after the roll-back the count starts afresh."""
    series = [[33.0, 34.0], [1.86, 1.87], [1.85, 1.88], [1.83, 1.87], [1.84, 1.86], [1.85, 1.84], [1.86, 1.86]]
    verdicts = _series(PlateauRule(steps=200), series, errors=[0.01, 0.01])
    assert [v.all_stuck for v in verdicts] == [False] * 5 + [True, False]
    assert verdicts[5].applied(Verdict([False, True], ["", "rose"], [0, 0])).reasons == ["plateau", "rose"]
    assert verdicts[5].applied(FINE).diverged == [True, True] and verdicts[4].applied(FINE) == FINE
    assert verdicts[6].history.best == 1.86 and verdicts[6].history.stuck_steps == 0  # a fresh first best


def test_a_short_run_waits_a_fifth_of_its_length_but_at_least_two_votes_and_twice_as_long_after_a_cut():
    """steps=200 is the most; 300 steps voting every 30 wait 300 // 5 = 60 (two votes), 128 voting every 32 wait
    64 (two votes, more than 128 // 5 = 25), 5000 steps wait 200 (not 1000); unknown length or the rule off: as
    set; after one ladder 120, after two 240."""
    rule = PlateauRule(steps=200)
    assert patience(rule, 300, 30) == 60 and patience(rule, 128, 32) == 64 and patience(rule, 5000, 100) == 200
    assert patience(rule, 400, 25) == 80 and patience(rule, None, 30) == 200
    assert patience(PlateauRule(steps=None), 300, 30) is None and patience(PlateauRule(steps=40), 300, 30) == 40
    assert patience(rule, 300, 30, cuts=1) == 120 and patience(rule, 300, 30, cuts=2) == 240


def test_no_ladder_starts_with_fewer_steps_left_than_the_wait():
    """A 300-step run waiting 60: a vote at step 240 may start a ladder (60 steps left to learn), one at 250 may not
    (50 left)."""
    assert judged_at(60, 300, 180) == 60 and judged_at(60, 300, 240) == 60 and judged_at(60, 300, 250) is None
    assert judged_at(60, None, 10_000) == 60 and judged_at(None, 300, 30) is None


def test_the_controller_sizes_the_rule_from_the_run_length():
    """At T = 30 in a 300-step run the stuck ensemble of the controller test below fails at its third vote (60
    stuck steps after the first best), not at the eighth (200 steps); the ladder then waits 120 steps, and a second
    one would need 240 steps left (a vote at 210 has 90): no second cut. With the length unknown it waits 200."""
    short, unknown = HDETController(HDETConfig(every_n_steps=30)), HDETController(HDETConfig(every_n_steps=30))
    short.run_steps = 300
    short.plateau_armed = unknown.plateau_armed = True  # the run failed before (a blow-up, as every crash run had)
    multipliers = [0.9, 0.96, 1.04, 1.1]
    rolled = []
    for step in range(30, 301, 30):
        first = [2.08] * 4 if step == 30 else None
        rolled.append(short.decide(_interval(step, [1.86] * 4, multipliers, first=first)).roll_back)
        assert not unknown.decide(_interval(step, [1.86] * 4, multipliers, first=first)).roll_back or step == 240
    assert rolled == [False, False, True] + [False] * 7 and short.plateau_cuts == 1 and unknown.plateau_cuts == 1


def test_warm_up_caught_groups_and_the_switch():
    history = PlateauHistory(2.0, 150, 50)
    warm = judge_plateau(PlateauRule(steps=200), history, FINE, [2.3, 2.3], 100, progress=False)
    assert not warm.all_stuck and warm.history == PlateauHistory(2.0, 150, 100)  # the interval is not counted
    off = judge_plateau(PlateauRule(steps=None), history, FINE, [2.3, 2.3], 500)
    assert not off.all_stuck and off.history.stuck_steps == 150
    caught = Verdict([False, True], ["", "non-finite"], [0, 0])  # group 1's 1.0 is not the ensemble's best
    result = judge_plateau(PlateauRule(steps=200), history, caught, [2.3, 1.0], 100)
    assert result.all_stuck and result.history.stuck_steps == 200
    none = judge_plateau(PlateauRule(steps=200), history, Verdict([True, True], ["x", "x"], [0, 0]), [1.0, 1.0], 100)
    assert not none.all_stuck and none.history.stuck_steps == 150


def test_ladder_descends_from_the_geometric_mean_in_the_groups_order():
    """Multipliers (2, 0.5): geometric mean 1, rungs 0.1 and 0.01; the higher LR gets the higher rung."""
    table = torch.tensor([[0.5, 1.0], [2.0, 4.0]], dtype=torch.float64)
    new = ladder(table, 0.1)
    assert torch.allclose(new, torch.tensor([[0.01, 0.02], [0.1, 0.2]], dtype=torch.float64))
    four = ladder(torch.ones(4, 1, dtype=torch.float64), 0.1)[:, 0].tolist()  # 0.1 x 10**(-k/3)
    assert [round(m, 6) for m in four] == [0.1, 0.046416, 0.021544, 0.01]
    assert ladder(torch.tensor([[3.0]], dtype=torch.float64), 0.1).tolist() == [[pytest.approx(0.3)]]


def test_the_ladders_lower_half_restarts_from_the_initial_model():
    assert from_initial(torch.tensor([[0.1], [0.01], [0.046], [0.022]], dtype=torch.float64)) == [
        False, True, False, True]
    assert from_initial(torch.tensor([[0.1], [0.01], [0.03]], dtype=torch.float64)) == [False, True, False]
    assert from_initial(torch.tensor([[0.1]], dtype=torch.float64)) == [False]


def test_history_round_trip():
    history = PlateauHistory(1.5, 100, 150)
    again = PlateauHistory()
    again.load_state_dict(history.state_dict())
    assert again == history
    fresh = forget(history, restarted=True)
    assert math.isnan(fresh.best) and fresh.stuck_steps == 0 and forget(history, False) == history


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"steps": 0}, "`PlateauRule.steps` must be"),
    ({"cut": 1.0}, "`PlateauRule.cut` must be"),
    ({"cut": 0.0}, "`PlateauRule.cut` must be"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlateauRule(**kwargs)
    with pytest.raises(ValueError, match="`plateau` must be None or a PlateauRule"):
        SafetyNet(plateau=200)


def test_a_training_loss_bin_above_the_start_arms_the_plateau_rule_only_for_votes_on_a_validation_metric():
    """Group 3's training-loss curve peaks at 3.0 in its first bin, above its start of 2.08 +- 0.05, while every
    group's vote loss has learned (1.60-1.70); six flat votes follow (T = 100, the rule's 200 steps). Voting on the
    training loss, whose rises the vote's losses would show, that bin is one probe's first steps at too high an LR:
    the rule stays unarmed and cuts nothing (before, the ladder came at 300: benchmark 2's MLP from its good LR, every
    seed, research log 2026-12-07). Voting on ``val_loss`` the validation may no longer show a blow-up: armed, the
    ladder at 300."""
    def run(monitor):
        controller, cuts = HDETController(HDETConfig(every_n_steps=100, monitor=monitor)), []
        losses = [1.60, 1.65, 1.62, 1.70]
        for k in range(1, 7):
            curves = None
            if k == 1:
                rows = []
                for g in range(4):
                    curve = LossCurve(8, 8)
                    for t in range(8):
                        curve.add(t, torch.tensor(3.0 if g == 3 and t == 0 else losses[g]))
                    rows.append(curve.row())
                curves = torch.stack(rows)
            interval = _interval(100 * k, losses, [0.9, 0.96, 1.04, 1.1], first=[2.08] * 4 if k == 1 else None)
            decision = controller.decide(replace(interval, curves=curves))
            cuts += [100 * k] if decision.reasons == ["plateau"] * 4 else []
        return controller, cuts

    training, cuts = run(None)
    assert training.rose_seen and not training.plateau_armed and cuts == []
    validation, cuts = run("val_loss")
    assert validation.rose_seen and validation.plateau_armed and cuts == [300]


def test_the_lowest_loss_rising_at_two_votes_in_a_row_is_memorising():
    """The lowest healthy loss per vote 1.0, 1.1, 1.2: the second rise (1.2 > 1.1 > 1.0) is memorising; a fall
    (0.9) or an unchanged low starts the count again; a diverged group's loss is not the ensemble's low; an older
    checkpoint's history (no low) has seen no rise."""
    history, seen = PlateauHistory(), []
    for lows in ([1.0, 2.0], [1.1, 2.0], [1.2, 0.5], [0.9, 2.0], [1.0, 2.0], [1.0, 2.0], [1.3, 2.0]):
        verdict = Verdict([False, lows[1] == 0.5], ["", ""], [0, 0])  # 0.5: a diverged group's loss
        seen.append(memorising(history, lows, verdict))
        history = judge_plateau(PlateauRule(steps=10_000), history, verdict, lows, step=50 * (len(seen))).history
    assert seen == [False, False, True, False, False, False, False]
    assert (history.low, history.rises) == (1.3, 1)
    again = PlateauHistory()
    again.load_state_dict({"best": 0.9, "stuck_steps": 0, "last_step": 300})
    assert math.isnan(again.low) and again.rises == 0 and not memorising(again, [5.0], FINE)
    assert again.state_dict() == {"best": 0.9, "stuck_steps": 0, "last_step": 300}  # round-trips as it was
    restored = PlateauHistory()
    restored.load_state_dict(history.state_dict())
    assert restored == history


def test_validation_votes_that_memorise_arm_the_plateau_rule_and_training_loss_votes_do_not():
    """Four groups from a start of 2.08 +- 0.05 learn to 1.60 at the first vote, then every group's loss rises,
    1.65 and 1.70 (T = 100, the rule's 200 steps): nothing blew up or collapsed. Voting on ``val_loss`` that is a
    run memorising its data: the second rise (vote 3) arms the rule, 200 steps after the best, and the ladder rolls
    back at once. Voting on the training loss the same numbers arm nothing (the rule waits for a failure)."""
    def run(monitor):
        controller, cuts = HDETController(HDETConfig(every_n_steps=100, monitor=monitor)), []
        for k, low in enumerate([1.60, 1.65, 1.70, 1.75], start=1):
            losses = [low, low + 0.05, low + 0.02, low + 0.1]
            decision = controller.decide(_interval(100 * k, losses, [0.9, 0.96, 1.04, 1.1],
                                                   first=[2.08] * 4 if k == 1 else None))
            cuts += [100 * k] if decision.reasons == ["plateau"] * 4 else []
        return controller, cuts

    validation, cuts = run("val_loss")
    assert validation.plateau_armed and cuts == [300] and not validation.rose_seen
    training, cuts = run(None)
    assert not training.plateau_armed and cuts == []


def _interval(step, losses, multipliers, first=None, final=False):
    table = torch.tensor(multipliers, dtype=torch.float64)[:, None]
    first_errors = [0.05] * len(losses) if first is not None else None
    return Interval(step, losses, [True] * len(losses), table, [0.3], True, final, None, first, first_errors)


def test_the_controller_rolls_a_stuck_ensemble_back_onto_the_ladder_and_leaves_a_learning_one_alone():
    """The default vote and safety net at T = 100: four groups at 300x the good LR sit at 1.86 from the first
    vote; the third vote has counted 200 stuck steps: every group rolls back, LRs 0.1..0.01 x the old geometric
    mean, the lower two rungs from the initial model."""
    stuck_run = HDETController(HDETConfig(every_n_steps=100))
    stuck_run.plateau_armed = True  # the run failed before (a blow-up, as every crash run had)
    assert stuck_run.keeps_initial and not HDETController(HDETConfig(safety_net=SafetyNet(plateau=None))).keeps_initial
    multipliers = [0.9, 0.96, 1.04, 1.1]
    for step in (100, 200):
        decision = stuck_run.decide(_interval(step, [1.86] * 4, multipliers, first=[2.08] * 4 if step == 100 else None))
        assert not decision.roll_back and decision.reasons == [""] * 4
        multipliers = decision.multipliers[:, 0].tolist()
    third = stuck_run.decide(_interval(300, [1.86] * 4, multipliers))
    assert third.roll_back and third.reasons == ["plateau"] * 4 and stuck_run.plateau_cuts == 1
    centre = math.exp(sum(math.log(m) for m in multipliers) / 4)
    new = third.multipliers[:, 0].tolist()
    assert max(new) == pytest.approx(0.1 * centre) and min(new) == pytest.approx(0.01 * centre)
    assert third.from_initial == [m < 0.03 * centre for m in new] and sum(third.from_initial) == 2
    assert stuck_run.plateau_history.stuck_steps == 0 and math.isnan(stuck_run.plateau_history.best)
    learning = HDETController(HDETConfig(every_n_steps=100))
    multipliers = [0.9, 0.96, 1.04, 1.1]
    for k, loss in enumerate([2.0, 1.9, 1.7, 1.6, 1.5, 1.45, 1.42], start=1):
        decision = learning.decide(_interval(100 * k, [loss + 0.01 * g for g in range(4)], multipliers,
                                             first=[2.08] * 4 if k == 1 else None))
        assert not decision.roll_back and not any(decision.rescued) and decision.from_initial == []
        multipliers = decision.multipliers[:, 0].tolist()
    switched_off = HDETController(HDETConfig(every_n_steps=100, safety_net=SafetyNet(plateau=None)))
    for step in (100, 200, 300, 400):
        assert not switched_off.decide(_interval(step, [1.86] * 4, [0.9, 0.96, 1.04, 1.1])).roll_back


def test_a_plateau_is_a_failure_only_in_a_run_that_has_failed():
    """Four groups flat at 1.86 from a start of 2.08 +- 0.05 (T = 100, the rule's 200 steps): never stuck, however
    long, while nothing failed (a slow start or too low an LR); one group once at 2.30 (above 2.08 + 2 x 0.05: a
    collapse knocked above the start) or a group caught by another rule arms the rule, which then fires after its
    200 steps (after a roll-back, from its next vote); the flag is checkpointed."""
    def run(blip_at=None, blip=2.30):
        controller, cuts = HDETController(HDETConfig(every_n_steps=100)), []
        for k in range(1, 7):
            losses = [1.86, 1.86, 1.86, blip if k == blip_at else 1.86]
            decision = controller.decide(_interval(100 * k, losses, [0.9, 0.96, 1.04, 1.1],
                                                   first=[2.08] * 4 if k == 1 else None))
            cuts += [100 * k] if decision.reasons == ["plateau"] * 4 else []
        return controller, cuts

    flat, cuts = run()
    assert cuts == [] and not flat.plateau_armed and flat.plateau_history.stuck_steps == 500
    assert run(blip_at=3, blip=2.17)[1] == []  # 2.17 is inside the start's noise band: no evidence
    knocked, cuts = run(blip_at=3)
    assert knocked.plateau_armed and cuts == [300] and knocked.state_dict()["plateau_armed"]
    # 40 > 10 x the best, under one shared gradient: every group rolls back to the last good merge at vote 2; the
    # count goes on through the roll-back (the restored model is at the best's level): 200 stuck steps at vote 3
    caught, cuts = run(blip_at=2, blip=40.0)
    assert caught.rescues == 5 and cuts == [300]
    resumed = HDETController(HDETConfig(every_n_steps=100))
    state = flat.state_dict()
    resumed.load_state_dict(state)
    assert not resumed.plateau_armed


def test_a_roll_back_flagged_initial_returns_to_the_model_the_fit_started_from():
    """One rank (one group of a FakeWorld): the restore point becomes a merge's target (half the model); a roll-back
    flagged ``initial`` writes the kept initial model instead, and without one kept falls back to the restore point."""
    from lightning_hdet.testing import FakeWorld
    from tests.test_hdet_fsdp import _ShardRank

    module = torch.nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[2.0, 4.0]]))
        module.bias.fill_(6.0)

    def roll_backs(executor) -> None:
        ops = _ShardRank(module, executor.hdet.groups.comm, 0, 1)
        ops.merger.ensure_restore_point(keep_initial=True)
        ops.merger.merge([0.5], [1.0], [False])  # the target, half the model, becomes the restore point and the model
        assert module.weight.tolist() == [[1.0, 2.0]] and ops.merger.restore_point.tolist() == [1.0, 2.0, 3.0]
        with torch.no_grad():
            module.bias.fill_(100.0)
        ops.merger.restore(initial=[True])
        assert module.weight.tolist() == [[2.0, 4.0]] and module.bias.tolist() == [6.0]
        ops.merger.restore(initial=[False])
        assert module.weight.tolist() == [[1.0, 2.0]] and module.bias.tolist() == [3.0]
        plain = _ShardRank(module, executor.hdet.groups.comm, 0, 1)
        plain.merger.ensure_restore_point()  # no initial model kept: the restore point it is
        with torch.no_grad():
            module.bias.fill_(100.0)
        plain.merger.restore(initial=[True])
        assert module.bias.tolist() == [3.0]

    FakeWorld([0.0], [1.0]).run(roll_backs)


def test_the_rule_is_an_option_of_the_safety_net():
    """``SafetyNet(plateau=...)`` reaches the controller; ``SafetyNet(plateau=None)`` and ``safety_net=False``
    switch it off, and with it the strategy's copy of the initial model unless the search restarts from it
    (``Search.restart_below``)."""
    from lightning_hdet import HDETCallback, SafetyNet, Search

    rule = PlateauRule(steps=50, cut=0.2)
    assert HDETCallback(safety_net=SafetyNet(plateau=rule)).controller.plateau == rule
    assert HDETCallback().controller.plateau == PlateauRule() and HDETCallback().controller.keeps_initial
    no_restart = Search(restart_below=None)
    assert not HDETCallback(safety_net=SafetyNet(plateau=None), search=no_restart).controller.keeps_initial
    assert not HDETCallback(safety_net=False, search=False).controller.keeps_initial
    assert HDETCallback(safety_net=False).controller.keeps_initial  # the default search may restart from it
    with pytest.raises(ValueError, match="`plateau` must be None or a PlateauRule"):
        SafetyNet(plateau=200)


def test_a_rescue_does_not_restart_the_count_and_a_ladder_may_start_with_one_wait_left():
    """The tabular crash run (research log 2026-12-05), T = 38 of 300 steps, patience max(2 x 38, 300 / 5) = 76:
    blow-ups at vote 1 (caught), the climb down to the labels' prior (2.066, then 1.887: new bests), one group
    blown up at 152 (31.1 > 10 x 1.887: caught, every group rolls back to the last good merge), 2.854 at 190. The
    count runs on through the roll-back (38 + 38 = 76 stuck steps at 190) and 110 steps are left (>= 76): the ladder
    starts at 190. Forgetting the best at the roll-back, or asking for 2 x 76 steps left, left this run stuck."""
    controller = HDETController(HDETConfig(every_n_steps=38))
    controller.run_steps = 300
    multipliers = [0.9, 0.96, 1.04, 1.1]
    votes = [(38, [45.1, 451.5, 7011.8, 53656.2]), (76, [2.115, 2.225, 2.543, 2.066]),
             (114, [2.018, 2.004, 1.961, 1.887]), (152, [2.863, 4.258, 10.47, 31.149]),
             (190, [2.854, 4.8, 10.569, 5.723])]
    ladders, rolled = [], []
    for step, losses in votes:
        decision = controller.decide(_interval(step, losses, multipliers, first=[2.08] * 4 if step == 38 else None))
        ladders.append(decision.reasons == ["plateau"] * 4)
        rolled.append(decision.roll_back)
        multipliers = decision.multipliers[:, 0].tolist()
    assert ladders == [False, False, False, False, True] and rolled[3] and controller.plateau_cuts == 1
    assert judged_at(76, 300, 190) == 76 and judged_at(76, 300, 228) is None  # 72 steps left at 228
