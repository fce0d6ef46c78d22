"""experimental.PB2 (lightning_hdet/experimental/pb2.py, the rule in one file): the kernel, the posterior and the
vote rule against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet import HDETCallback
from lightning_hdet.experimental import Improvement
from lightning_hdet.experimental.pb2 import PB2, Posterior, standardise, time_kernel, ucb_picks
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.selection import PBT
from lightning_hdet.hdet.rules.votes import Ballot


def _rows(*rows: tuple[float, float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _same_table(actual: list[list[float]], expected: list[list[float]]) -> None:
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64))


def test_the_kernel_forgets_older_intervals():
    # exp(-0.5^2 / (2 * 0.5^2)) * (1 - 0.19) ** (2 / 2) = exp(-0.5) * 0.81
    k = time_kernel(_rows((0.0, 0.0)), _rows((2.0, 0.5), (0.0, 0.0)), length_scale=0.5, epsilon=0.19)
    assert k[0].tolist() == pytest.approx([0.81 * math.exp(-0.5), 1.0])


def test_one_observation_posterior_and_likelihood():
    # one point y = 1 with noise s2 = 0.1: mean k / (1 + s2) * y, variance 1 - k^2 / (1 + s2) at the point itself
    posterior = Posterior(_rows((0.0, 0.5)), torch.tensor([1.0], dtype=torch.float64), 0.2, 0.1, 0.1)
    mean, std = posterior.predict(_rows((0.0, 0.5), (0.0, 0.7)))
    k = math.exp(-0.2**2 / (2 * 0.2**2))
    assert mean.tolist() == pytest.approx([1 / 1.1, k / 1.1])
    assert std.tolist() == pytest.approx([math.sqrt(1 - 1 / 1.1), math.sqrt(1 - k * k / 1.1)])
    assert posterior.log_likelihood() == pytest.approx(-0.5 / 1.1 - 0.5 * math.log(1.1) - 0.5 * math.log(2 * math.pi))


def test_rewards_are_centred_per_interval_and_scaled():
    # centred: [-1, 1, -2, 2]; their root mean square: sqrt(10 / 4)
    scale = math.sqrt(2.5)
    assert standardise([0, 0, 1, 1], [1.0, 3.0, 10.0, 14.0]) == pytest.approx([-1 / scale, 1 / scale, -2 / scale,
                                                                                2 / scale])
    assert standardise([0, 0], [2.0, 2.0]) == [0.0, 0.0]  # no spread: nothing to scale


def test_ucb_picks_the_peak_then_the_unknown():
    log = math.log
    peak = [[0, log(0.5), 0.0], [0, log(1.0), 1.0], [0, log(2.0), 0.0]]
    # no exploration: the posterior mean of a symmetric peak is highest at its centre, a candidate of the grid
    assert ucb_picks(peak, 1, 0.5, 2.0, 1, kappa=0.0, epsilon=0.1) == pytest.approx([1.0])
    # equal rewards: the mean is flat and the bound is highest farthest from the data, at the top of the range
    flat = [[0, log(0.5), 1.0], [0, log(1.0), 1.0]]
    assert ucb_picks(flat, 1, 0.5, 2.0, 1, kappa=1.0, epsilon=0.1) == pytest.approx([2.0])
    # a second mover in the same vote goes elsewhere: the first pick counts as observed (at its mean, in the
    # current interval), so the bound is now highest in the gap of the older observations, not near the first
    first, second = ucb_picks(flat, 1, 0.5, 2.0, 2, kappa=1.0, epsilon=0.1)
    assert first == pytest.approx(2.0) and 0.5 < second < 1.0


def _ballot(losses, multipliers, healthy=None) -> Ballot:
    return Ballot(0, losses, multipliers, healthy or [True] * len(losses), 1.0, True)


def test_pb2_records_improvements_from_where_each_group_started():
    rule, gen = PB2(), torch.Generator().manual_seed(0)
    first = rule.explore(_ballot([1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.0, 4.0]), gen)
    # PBT's selection: the worst group copies the best; every group started from the same model
    assert first.sources == [0, 1, 2, 0] and first.winner == 0 and first.weights == [1.0, 0.0, 0.0, 0.0]
    _same_table(rule.observations[0], [[0, math.log(m), -loss] for m, loss in
                                       zip([0.5, 1.0, 2.0, 4.0], [1.0, 2.0, 3.0, 4.0])])
    assert rule.starts[0] == [1.0, 2.0, 3.0, 1.0]  # group 3 starts where group 0 ended
    # the lowest LR was best: the bound's pick is the bottom of the range, leader x0.8
    assert first.multipliers == pytest.approx([0.5, 1.0, 2.0, 0.4])
    multipliers = first.multipliers
    second = rule.explore(_ballot([0.5, 1.9, 2.9, 0.6], multipliers, [True, True, False, True]), gen)
    # improvements from the starts; the unhealthy group 2 is not observed
    _same_table(rule.observations[0][4:], [[1, math.log(multipliers[g]), r] for g, r in
                                           ((0, 0.5), (1, 0.1), (3, 0.4))])
    assert second.sources == [0, 1, 0, 3] and rule.intervals == {0: 2}


def test_pb2_moves_up_to_the_lr_that_improves_most_against_a_lower_level():
    """Short-horizon bias: at the third vote the lowest LR leads by level, but the highest LR improved the most from
    where it started. PBT's mover takes the leader's LR x0.8 or x1.2; PB2's goes to the top of the range."""
    multipliers = [0.5, 1.0, 2.0, 4.0]
    votes = ([2.0, 2.0, 2.0, 2.0], [1.0, 1.3, 1.4, 1.2], [0.7, 1.0, 0.95, 0.75])
    pb2, pbt = PB2(kappa=0.0), PBT(resample_probability=0.0)
    gens = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for losses in votes:
        third, by_level = (rule.explore(_ballot(losses, multipliers), g) for rule, g in zip((pb2, pbt), gens))
    # starts [1.0, 1.3, 1.0, 1.2] (group 2 copied group 0 at the second vote): improvements 0.3, 0.3, 0.05, 0.45
    assert pb2.starts[0] == [0.7, 0.7, 0.95, 0.75]
    _same_table(pb2.observations[0][-4:], [[2, math.log(m), r] for m, r in zip(multipliers, (0.3, 0.3, 0.05, 0.45))])
    assert third.winner == by_level.winner == 0 and third.sources == by_level.sources == [0, 0, 2, 3]
    assert by_level.multipliers[1] <= 0.6 + 1e-12  # 0.4, 0.6 or its floor 0.5 / 1.2 below the leader
    assert third.multipliers[1] > 2.0  # the mover copies group 0's model, at a higher LR than any but group 3's


def test_pb2_perturbs_as_pbt_where_its_range_is_empty():
    # factors (1, 1) and one multiplier for all: no range to search; PBT's perturbation (x1.0) instead
    rule = PB2(factors=(1.0, 1.0), resample_probability=0.0)
    result = rule.explore(_ballot([1.0, 2.0], [1.0, 1.0]), torch.Generator().manual_seed(0))
    assert result.multipliers == [1.0, 1.0] and result.sources == [0, 0]


def test_pb2_state_round_trips():
    rule, gen = PB2(), torch.Generator().manual_seed(0)
    rule.explore(_ballot([1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.0, 4.0]), gen)
    restored = PB2()
    restored.load_state_dict(rule.state_dict())
    ballot = _ballot([0.5, 1.9, 2.9, 0.6], [0.5, 1.0, 2.0, 0.4])
    state = gen.get_state()
    a = rule.explore(ballot, gen)
    b = restored.explore(ballot, torch.Generator().set_state(state))
    assert (a.multipliers, a.sources) == (b.multipliers, b.sources)
    restored.load_state_dict({})  # what the end of a search does: a fresh rule
    assert (restored.observations, restored.starts, restored.intervals, restored.votes) == ({}, {}, {}, {})


def test_the_controller_builds_pb2_and_ends_on_the_best_group():
    controller = HDETController(HDETConfig(vote=PB2()))
    assert isinstance(controller.rule, PB2)
    table = torch.tensor([[0.5], [1.5]], dtype=torch.float64)
    final = controller.decide(Interval(8, [2.0, 1.0], [True, True], table, [0.1], False, final=True))
    assert final.coefficients == [0.0, 1.0] and final.strengths == [1.0, 1.0]  # like pbt: the winner's model
    assert final.multipliers.tolist() == table.tolist()  # and the LRs left alone
    with pytest.raises(ValueError, match=r"`vote` must be one of .*'pbt'"):
        HDETCallback(vote="pb3")
    with pytest.raises(ValueError, match=r"`signal` must be a level .* with vote=PB2\(\).*improvement itself"):
        HDETCallback(vote=PB2(), signal=Improvement())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"kappa": -1.0}, r"`kappa`"), ({"epsilon": 1.0}, r"`epsilon`"), ({"window": 1}, r"`window`"),
    ({"quantile": 0.9}, r"`quantile`"),
])
def test_pb2_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PB2(**kwargs)
