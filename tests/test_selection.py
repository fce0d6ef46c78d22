"""PBT-style truncation selection and merge plans, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.rules.selection import PBT, MergeStep, copy_plan, plan_matrix, quantile_size
from lightning_hdet.hdet.rules.votes import Ballot


def _ballot(losses, multipliers, healthy=None, move=True, key=0):
    healthy = healthy or [True] * len(losses)
    return Ballot(key, losses, multipliers, healthy, schedule_lr=0.1, move=move)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_quantile_size_follows_ray_tune():
    assert [quantile_size(g, 0.25) for g in (1, 2, 3, 4, 5, 8, 16)] == [0, 1, 1, 1, 2, 2, 4]
    assert quantile_size(8, 0.5) == 4


def test_only_the_worst_moves_copying_the_best():
    rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    result = rule.explore(_ballot([3.0, 1.0, 2.0, 4.0], [0.5, 1.0, 2.0, 4.0]), _gen())
    assert result.winner == 1 and result.weights == [0.0, 1.0, 0.0, 0.0]
    assert result.sources == [0, 1, 2, 1]  # group 3 (worst) copies group 1 (best); the others keep theirs
    assert result.multipliers == pytest.approx([0.5, 1.0, 2.0, 0.8])  # 1.0 * 0.8; 2.0 above, 0.5 below the leader


def test_spread_is_kept_upward_first():
    rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    result = rule.explore(_ballot([1.0, 2.0], [1.0, 1.0]), _gen())
    # the mover drew 0.8, but nothing sat 1.2x above the leader: it is placed there
    assert result.multipliers == pytest.approx([1.0, 1.2])
    rule = PBT(resample_probability=0.0, factors=(1.1, 1.1))
    result = rule.explore(_ballot([1.0, 2.0, 3.0], [1.0, 1.3, 1.0]), _gen())
    assert result.multipliers == pytest.approx([1.0, 1.3, 1 / 1.2])  # group 1 is above: the mover goes below


def test_a_grid_whose_edge_keeps_winning_travels_that_way_by_its_own_spacing():
    """One win of the highest LR places the probe x1.2 above it (a first lead is often noise); a second in a row
    places it one step of the grid's spacing beyond (the default search's 2.28x), and every further one again: a
    geometric walk. The lowest edge walks down alike; a win inside the grid ends the streak; the streak outlives the
    search's end (``carried``) and a checkpoint."""
    rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    grid = [27 ** -0.25, 1.0, 27 ** 0.25, 27 ** 0.5]  # the default search's grid: 2.28x apart
    first = rule.explore(_ballot([4.0, 3.0, 2.0, 1.0], grid), _gen())  # the highest LR leads once
    assert first.sources == [3, 1, 2, 3] and first.multipliers[0] == pytest.approx(27 ** 0.5 * 1.2)
    second = rule.explore(_ballot([4.0, 3.0, 2.0, 1.0], grid), _gen())  # ... and again: one grid step beyond it
    assert second.multipliers[0] == pytest.approx(27 ** 0.75) and rule.streaks == {0: 2}
    walked = [second.multipliers[0]]
    for _ in range(2):  # the probe leads from the top: the walk goes on, 2.28x a vote
        table = [walked[-1] / 27 ** 0.5, walked[-1] / 27 ** 0.25, walked[-1]]
        walked.append(max(rule.explore(_ballot([3.0, 2.0, 1.0], table), _gen()).multipliers))
    assert walked[-1] == pytest.approx(27 ** 1.25) and rule.streaks == {0: 4}
    after = PBT(resample_probability=0.0)
    after.load_state_dict(rule.carried())  # the search's end: the streak stays
    assert after.streaks == {0: 4}
    rule.explore(_ballot([2.0, 1.0, 3.0, 4.0], grid), _gen())  # a win inside: the streak ends
    assert rule.streaks == {0: 0}
    for _ in range(2):
        low = rule.explore(_ballot([1.0, 2.0, 3.0, 4.0], grid), _gen())  # the lowest leads twice
    assert rule.streaks == {0: -2} and min(low.multipliers) == pytest.approx(27 ** -0.5)
    restored = PBT(resample_probability=0.0)
    restored.load_state_dict(rule.state_dict())
    assert restored.streaks == {0: -2}
    still = PBT(resample_probability=0.0, factors=(0.8, 0.8), travel=False)  # no travel: x1.2 beyond, every time
    for _ in range(3):
        kept = still.explore(_ballot([4.0, 3.0, 2.0, 1.0], grid), _gen())
    assert kept.multipliers[0] == pytest.approx(27 ** 0.5 * 1.2)


def test_perturbation_draws_both_directions_and_resamples_log_uniformly():
    rule = PBT(resample_probability=0.0)
    seen = {round(rule.explore(_ballot([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 0.5, 3.0]), _gen(s)).multipliers[3], 6)
            for s in range(20)}
    assert seen == {0.8, 1.2}
    rule = PBT(resample_probability=1.0)
    gen = _gen(5)
    u = torch.rand(2, generator=_gen(5), dtype=torch.float64).tolist()[1]
    result = rule.explore(_ballot([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 0.5, 3.0]), gen)
    assert result.multipliers[3] == pytest.approx(math.exp(math.log(0.5) + u * (math.log(3.0) - math.log(0.5))))


def test_unhealthy_groups_all_move_and_pairs_follow_the_ranking():
    rule = PBT(resample_probability=0.0, factors=(1.2, 1.2))
    result = rule.explore(_ballot([2.0, math.nan, 1.0, 5.0], [1.0, 1.0, 1.0, 1.0], [True, False, True, True]), _gen())
    assert result.sources == [0, 2, 2, 3]  # the NaN group ranks last: it fills the bottom quantile
    result = rule.explore(_ballot([2.0, math.nan, 1.0, math.inf], [1.0] * 4, [True, False, True, True]), _gen())
    assert result.sources == [0, 2, 2, 2]  # every unhealthy group moves, even past the quantile
    rule = PBT(resample_probability=0.0)
    assert rule.pairs(_ballot([float(g) for g in range(8)], [1.0] * 8)) == {7: 0, 6: 1}


def test_no_move_before_warmup_and_state_round_trip():
    rule = PBT()
    result = rule.explore(_ballot([1.0, 2.0], [1.0, 2.0], move=False), _gen())
    assert result.multipliers == [1.0, 2.0] and result.sources == [0, 1]
    other = PBT()
    other.load_state_dict({"votes": {"0": 3}, "streaks": {"0": -2}})  # (a checkpoint's old vote counts: unused)
    assert other.state_dict() == {"streaks": {0: -2}}


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="`quantile` must be a number in"):
        PBT(quantile=0.75)
    with pytest.raises(ValueError, match="`factors` must be two positive finite numbers"):
        PBT(factors=(1.2,))
    with pytest.raises(ValueError, match="`min_spread`"):
        PBT(min_spread=0.0)


def test_copy_plan_one_step_per_source_and_its_matrix():
    plan = copy_plan([0, 0, 2, 2], strength=0.5, rescued=[False, False, False, True])
    assert plan == [MergeStep([1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]),
                    MergeStep([0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0])]
    assert plan_matrix(plan, 4) == [[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0],
                                    [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    assert copy_plan([0, 1, 2]) == []
    assert plan_matrix([MergeStep([0.25] * 4, [1.0] * 4)], 4) == [[0.25] * 4] * 4  # the published mean merge
    with pytest.raises(ValueError, match="sources are not themselves copied into"):
        copy_plan([1, 2, 2])


def test_a_vote_on_which_no_group_learned_probes_beyond_the_edge_it_names():
    """No group has learned (``Ballot.direction``): the losses are ties, so the edge the direction names leads. Up:
    half the groups (the worst by noise, 1 and 2) copy the best two and probe one and two grid spacings above the
    highest LR (27 ** 0.75, 27), and the streak counts a top win; down: the same below the lowest (27 ** -0.5,
    27 ** -0.75). The same ballot without a direction: one mover, at the noise winner's LR x0.8, a bottom win. A
    leader that is a mover itself (the highest LR the worst) is read as voted on."""
    grid = [27 ** -0.25, 1.0, 27 ** 0.25, 27 ** 0.5]
    ties = [1.795, 1.799, 1.797, 1.796]
    rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    up = rule.explore(Ballot(0, ties, grid, [True] * 4, 0.1, True, direction=1), _gen())
    assert up.sources == [0, 0, 3, 3] and up.multipliers == pytest.approx([grid[0], 27 ** 0.75, 27.0, grid[3]])
    assert rule.streaks == {0: 1}
    down_rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    down = down_rule.explore(Ballot(0, ties, grid, [True] * 4, 0.1, True, direction=-1), _gen())
    assert down.multipliers == pytest.approx([grid[0], 27 ** -0.5, 27 ** -0.75, grid[3]])
    assert down_rule.streaks == {0: -1}
    plain_rule = PBT(resample_probability=0.0, factors=(0.8, 0.8))
    plain = plain_rule.explore(Ballot(0, ties, grid, [True] * 4, 0.1, True), _gen())
    assert plain.sources == [0, 0, 2, 3] and plain.multipliers[1] == pytest.approx(27 ** -0.25 * 0.8)
    assert plain_rule.streaks == {0: -1}
    top_worst = PBT(resample_probability=0.0, factors=(0.8, 0.8)).explore(
        Ballot(0, [1.795, 1.796, 1.797, 1.799], grid, [True] * 4, 0.1, True, direction=1), _gen())
    assert top_worst.sources == [0, 1, 1, 0] and top_worst.multipliers[2:] == pytest.approx([27 ** 0.75, 27.0])
