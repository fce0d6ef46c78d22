import pytest
import torch

from lightning_hdet.asynchronous.outer.local_steps import (
    AdaptiveSteps,
    LocalStepsPolicy,
    dynamic_local_steps,
    smoothed_speed,
)
from lightning_hdet.asynchronous.outer.settings import OuterSettings


def test_dynamic_local_steps_formula():
    speeds = {0: 100.0, 1: 75.0, 2: 38.4, 3: 17.4}
    assert [dynamic_local_steps(speeds[w], speeds, 50, 1) for w in range(4)] == [50, 37, 19, 8]


def test_dynamic_local_steps_lower_bound_and_unknown_speed():
    speeds = {0: 100.0, 1: 1.0}
    assert dynamic_local_steps(1.0, speeds, 50, 3) == 3
    assert dynamic_local_steps(None, speeds, 50, 3) == 50
    assert dynamic_local_steps(None, {}, 50, 1) == 50


def test_exchange_time_counts_in_the_cycle_every_worker_matches():
    # cycles at H = 8: worker 0 8/100 + 0 = 0.08 s, worker 1 8/400 + 0.05 = 0.07 s, so T = 0.07:
    # worker 0 floor(100 * 0.07) = 7 (compute alone would give it floor(100/400 * 8) = 2), worker 1 floor(400 * 0.02) = 8
    speeds, exchanges = {0: 100.0, 1: 400.0}, {0: 0.0, 1: 0.05}
    assert dynamic_local_steps(100.0, speeds, 8, 1, 0.0, exchanges) == 7
    assert dynamic_local_steps(400.0, speeds, 8, 1, 0.05, exchanges) == 8
    assert dynamic_local_steps(100.0, speeds, 8, 1) == 2
    # an exchange longer than the quickest cycle (0.08 s): the lower bound
    assert dynamic_local_steps(100.0, {0: 100.0, 1: 100.0}, 8, 3, 0.1, {0: 0.1}) == 3


def test_policy_smooths_exchange_times_forgets_and_loads_old_checkpoints():
    policy = LocalStepsPolicy(local_steps=8, smoothing=0.5)
    policy.update(0, 8, 0.08, 0.0)
    policy.update(1, 8, 0.02, 0.02)
    policy.update(1, 8, 0.02, 0.08)  # smoothed: 0.5 * 0.02 + 0.5 * 0.08 = 0.05
    assert policy.exchanges == pytest.approx({0: 0.0, 1: 0.05})
    assert policy.next_local_steps(0) == 7
    other = LocalStepsPolicy(local_steps=8)
    other.load_state_dict(policy.state_dict())
    assert other.next_local_steps(0) == 7
    other.load_state_dict({"speeds": policy.state_dict()["speeds"]})  # saved before exchange times were kept
    assert other.exchanges == {} and other.next_local_steps(0) == 2
    policy.forget(1)
    assert policy.speeds == {0: 100.0} and policy.exchanges == {0: 0.0} and policy.next_local_steps(0) == 8


def test_smoothed_speed():
    assert smoothed_speed(None, 10.0, 0.5) == 10.0
    assert smoothed_speed(10.0, 20.0, 0.5) == 15.0
    assert smoothed_speed(10.0, 20.0, 0.0) == 20.0


def test_policy_converges_to_speed_ratio():
    policy = LocalStepsPolicy(local_steps=40, min_local_steps=1, smoothing=0.5)
    for _ in range(10):
        policy.update(0, 40, 1.0)  # 40 steps/s
        policy.update(1, 10, 1.0)  # 10 steps/s
    assert policy.next_local_steps(0) == 40
    assert policy.next_local_steps(1) == 10
    assert policy.next_local_steps(7) == 40  # unseen worker starts with H


def test_policy_static_and_state_dict():
    policy = LocalStepsPolicy(local_steps=8, dynamic=False)
    policy.update(0, 8, 1.0)
    policy.update(1, 8, 4.0)
    assert policy.next_local_steps(1) == 8
    other = LocalStepsPolicy(local_steps=8)
    other.load_state_dict(policy.state_dict())
    assert other.speeds == {0: 8.0, 1: 2.0}
    assert other.next_local_steps(1) == 2


def test_policy_ignores_empty_rounds():
    policy = LocalStepsPolicy(local_steps=8)
    policy.update(0, 0, 1.0)
    policy.update(0, 5, 0.0)
    assert policy.speeds == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(local_steps=0), "local_steps"),
        (dict(local_steps=4, min_local_steps=0), "min_local_steps"),
        (dict(local_steps=4, min_local_steps=5), "min_local_steps"),
        (dict(local_steps=4, smoothing=1.0), "speed_smoothing"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalStepsPolicy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(start=4, min=8), r"`min` must be at most start=4, got 8"),
        (dict(start=4, min=0), r"`min` must be a positive integer, got 0"),
        (dict(grace_period=float("inf")), "`grace_period` must be a finite number >= 0, got inf"),
        (dict(smoothing=1.0), r"`smoothing` must be a number in \[0, 1\), got 1.0"),
        (dict(start=2.5), "`start` must be a positive integer, got 2.5"),
    ],
)
def test_adaptive_steps_are_checked_on_creation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveSteps(**kwargs)


def _rounds_after_one_slow_round(local_steps, mode="async") -> list[int]:
    """The next round's length of workers 0 and 1 after each ran 8 steps, worker 1 four times slower (a budget of
    1000 steps: far from its end)."""
    outer = OuterSettings(mode=mode, local_steps=local_steps).build(torch.zeros(1), torch.zeros(0), 2, budget=1000)
    outer.local_steps.update(0, 8, 1.0)
    outer.local_steps.update(1, 8, 4.0)
    return [outer.step_policy.allocate(outer, w, 2) for w in (0, 1)]


def test_an_integer_is_fixed_rounds_in_either_mode():
    """What a user writes is what runs: ``local_steps=8`` gives the slow worker 8 steps too, async as DiLoCo; only
    an explicit ``AdaptiveSteps(start=8)`` gives it 8 / 4 = 2."""
    assert OuterSettings(local_steps=20).local_steps == OuterSettings(mode="sync", local_steps=20).local_steps == 20
    assert _rounds_after_one_slow_round(8) == [8, 8]
    assert _rounds_after_one_slow_round(8, "sync") == [8, 8]
    assert _rounds_after_one_slow_round(AdaptiveSteps(8)) == [8, 2]


def test_unset_local_steps_are_adaptive_in_async_mode_and_50_in_diloco():
    assert OuterSettings().local_steps == AdaptiveSteps(start=50)
    assert OuterSettings(mode="sync").local_steps == 50
    assert _rounds_after_one_slow_round(None) == [50, 12]  # floor(50 / 4)
