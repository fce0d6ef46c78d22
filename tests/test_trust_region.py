"""The trust-region vote against hand-computed regions, in one process."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.selection import PBT
from lightning_hdet.hdet.rules.trust_region import TrustRegion, slot
from lightning_hdet.hdet.rules.votes import Ballot

G = torch.Generator()


def _vote(rule, losses, multipliers, move=True, healthy=None):
    healthy = [True] * len(losses) if healthy is None else healthy
    return rule.explore(Ballot(0, losses, multipliers, healthy, 0.1, move), G)


def _close(a, b):
    return all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b)) and len(a) == len(b)


def test_slots_two_edges_and_a_centre():
    assert [slot(g, 4) for g in range(4)] == [-1, 0, 0, 1] and [slot(g, 2) for g in range(2)] == [-1, 1]


def test_a_winning_edge_moves_the_incumbent_and_a_streak_grows_the_region_up_to_its_cap():
    """Start (0.5, 1, 2): incumbent 1, r 2. High edge wins: incumbent 2 (r stays 2: no streak yet); again:
    incumbent 2 x 2 = 4, r 2**2 = 4; again: incumbent 4 x 4 = 16, r 16 capped at 10."""
    rule = TrustRegion()
    result = _vote(rule, [3.0, 2.0, 1.0], [0.5, 1.0, 2.0])
    assert result.winner == 2 and result.weights == [0.0, 0.0, 1.0] and _close(result.multipliers, [1.0, 2.0, 4.0])
    assert _close(_vote(rule, [3.0, 2.0, 1.0], result.multipliers).multipliers, [1.0, 4.0, 16.0])
    assert _close(_vote(rule, [3.0, 2.0, 1.0], [1.0, 4.0, 16.0]).multipliers, [1.6, 16.0, 160.0])
    region = rule.regions[0]
    assert region.incumbent == pytest.approx(16.0) and region.ratio == 10.0 and region.last_edge == 1


def test_the_centre_winning_shrinks_the_region_to_its_floor_and_ends_the_streak():
    """From incumbent 16, r 10: the centre wins: r = 10 ** 0.5; the low edge then wins: incumbent 16 / 10 ** 0.5,
    r unchanged (no streak); the centre wins four more times: r = 10 ** 0.25, 0.125, 0.0625, then the floor 1.1."""
    rule = TrustRegion()
    rule.load_state_dict({"regions": {0: [16.0, 10.0, 1]}})
    centre = [2.0, 1.0, 2.0]
    assert _close(_vote(rule, centre, [1.0] * 3).multipliers, [16 / 10**0.5, 16.0, 16 * 10**0.5])
    assert rule.regions[0].ratio == pytest.approx(10**0.5) and rule.regions[0].last_edge == 0
    result = _vote(rule, [1.0, 2.0, 3.0], [1.0] * 3)
    r = 10**0.5
    assert _close(result.multipliers, [16 / r / r, 16 / r, 16.0])
    for _ in range(4):  # 1.778, 1.334, 1.155, 1.075 -> 1.1 (the floor)
        result = _vote(rule, centre, [1.0] * 3)
    assert rule.regions[0].ratio == 1.1 and _close(result.multipliers, [16 / r / 1.1, 16 / r, 16 / r * 1.1])


def test_two_groups_shrink_when_the_winning_edge_changes_sides():
    rule = TrustRegion()
    assert _close(_vote(rule, [2.0, 1.0], [0.5, 2.0]).multipliers, [1.0, 4.0])  # incumbent 2
    result = _vote(rule, [1.0, 2.0], [1.0, 4.0])  # the low edge: incumbent 2 / 2 = 1, r 2 ** 0.5
    assert _close(result.multipliers, [1 / 2**0.5, 2**0.5])


def test_no_move_before_warm_up_and_no_healthy_group_leave_the_multipliers():
    rule = TrustRegion()
    assert _vote(rule, [3.0, 2.0, 1.0], [0.5, 1.0, 2.0], move=False).multipliers == [0.5, 1.0, 2.0]
    assert rule.regions[0].incumbent == pytest.approx(1.0)  # centred on the start's geometric mean already
    result = _vote(rule, [3.0, 2.0, 1.0], [0.5, 1.0, 2.0], healthy=[True, False, False])
    assert result.winner == 0 and _close(result.multipliers, [0.25, 0.5, 1.0])  # the low edge won among the healthy
    assert _vote(rule, [1.0, 1.0, 1.0], [1.0] * 3, healthy=[False] * 3).multipliers == [1.0] * 3


def test_state_round_trip_and_bad_arguments():
    rule = TrustRegion()
    _vote(rule, [3.0, 2.0, 1.0], [0.5, 1.0, 2.0])
    again = TrustRegion()
    again.load_state_dict(rule.state_dict())
    assert again.regions == rule.regions
    with pytest.raises(ValueError, match="`ratio` must be within"):
        TrustRegion(ratio=20.0)
    with pytest.raises(ValueError, match="`shrink` must be"):
        TrustRegion(shrink=0.0)
    with pytest.raises(ValueError, match="`num_groups` must be at least 2"):
        _vote(TrustRegion(), [1.0], [1.0])


def test_the_controller_runs_the_vote_object():
    controller = HDETController(HDETConfig(vote=TrustRegion(blend="best")))
    table = torch.tensor([[0.5], [1.0], [2.0]], dtype=torch.float64)
    decision = controller.decide(Interval(100, [3.0, 2.0, 1.0], [True] * 3, table, [0.1], True))
    assert decision.winner == 2 and decision.coefficients == [0.0, 0.0, 1.0]
    assert _close(decision.multipliers[:, 0].tolist(), [1.0, 2.0, 4.0])


def test_its_options_live_on_the_vote_object_and_the_name_gives_its_defaults():
    """``TrustRegion(ratio=3)``: the first vote, won by a centre group of four at multipliers 1, shrinks
    ``log r`` by half: the edges at ``1 / sqrt(3)`` and ``sqrt(3)``; ``"trust_region"`` is ``TrustRegion()``."""
    from lightning_hdet import Best, HDETCallback

    callback = HDETCallback(vote=TrustRegion(ratio=3.0, blend="best"), search=False)
    assert callback.settings.vote.blend == "best" and callback.controller.rule.ratio == 3.0
    table = torch.ones(4, 1, dtype=torch.float64)
    decision = callback.controller.decide(Interval(100, [2.0, 1.0, 1.5, 3.0], [True] * 4, table, [0.1], True))
    assert _close(decision.multipliers[:, 0].tolist(), [3 ** -0.5, 1.0, 1.0, 3 ** 0.5])
    assert HDETCallback(vote="trust_region").controller.rule == TrustRegion()
    with pytest.raises(ValueError, match="`ratio` must be"):
        TrustRegion(ratio=1.0)
    with pytest.raises(TypeError, match="ratio"):  # an option of another rule does not exist on this one
        Best(ratio=3.0)


def test_it_is_refused_unless_every_group_shares_one_gradient():
    """Under ``gradient_sync="group"`` the centre groups would be separate runs of one LR (no cheap plain-DDP run):
    refused (at the callback's setup) with the fix; ``"global"`` and the other votes pass."""
    with pytest.raises(ValueError, match="`gradient_sync` must be 'global' with vote=TrustRegion"):
        TrustRegion().check_strategy("group", [])
    TrustRegion().check_strategy("global", [])
    PBT().check_strategy("group", ["weight_decay"])
    with pytest.raises(ValueError, match=r"`vote` must be not 'trust_region' with explore=\['weight_decay'\]"):
        TrustRegion().check_strategy("global", ["weight_decay"])
