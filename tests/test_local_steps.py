import pytest

from lightning_hdet.asynchronous.local_steps import LocalStepsPolicy, dynamic_local_steps, smoothed_speed


def test_dynamic_local_steps_formula():
    speeds = {0: 100.0, 1: 75.0, 2: 38.4, 3: 17.4}
    assert [dynamic_local_steps(speeds[w], speeds, 50, 1) for w in range(4)] == [50, 37, 19, 8]


def test_dynamic_local_steps_lower_bound_and_unknown_speed():
    speeds = {0: 100.0, 1: 1.0}
    assert dynamic_local_steps(1.0, speeds, 50, 3) == 3
    assert dynamic_local_steps(None, speeds, 50, 3) == 50
    assert dynamic_local_steps(None, {}, 50, 1) == 50


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
