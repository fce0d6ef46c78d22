"""Vote rules as pure objects: hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.layout import fan_out
from lightning_hdet.hdet.rules.options import VOTES, as_vote
from lightning_hdet.hdet.rules.votes import Ballot, Best, Softmax, divergent, softmax_weights, winner_of

G = torch.Generator


def test_fan_out_matches_published_formula():
    m = fan_out(8, 1 / 9)
    assert m[0] == pytest.approx(1 - 1 / 9) and m[-1] == pytest.approx(1 + 1 / 9)
    assert sum(m) / 8 == pytest.approx(1.0)
    assert fan_out(1, 0.5) == [1.0]
    assert fan_out(2, 0.5) == pytest.approx([0.5, 1.5])


def test_softmax_weights_hand_computed():
    w = softmax_weights([1.0, 1.2, 0.8], [True, True, True], temperature=0.1)
    logits = [0.0, -2.0, 2.0]
    z = sum(math.exp(x) for x in logits)
    assert w == pytest.approx([math.exp(x) / z for x in logits])
    w = softmax_weights([1.0, float("nan"), 0.8], [True, False, True], temperature=0.1)
    assert w[1] == 0.0 and sum(w) == pytest.approx(1.0)
    assert w == pytest.approx([1 / (1 + math.exp(2)), 0.0, math.exp(2) / (1 + math.exp(2))])


def test_softmax_controller_delta_sign_momentum_and_base():
    rule = Softmax(temperature=0.1, momentum=0.9, meta_lr=0.5, permute=False)
    mult = [0.5, 1.0, 1.5]
    # the highest-LR group has the lowest loss: delta > 0, base LR grows
    res = rule.explore(Ballot(0, [1.0, 0.9, 0.8], mult, [True] * 3, 0.01, True), G().manual_seed(0))
    w = softmax_weights([1.0, 0.9, 0.8], [True] * 3, 0.1)
    lrs = [0.01 * m for m in mult]
    delta = sum(a * b for a, b in zip(w, lrs)) - sum(lrs) / 3
    assert delta > 0
    v = 0.1 * delta
    assert rule.velocity[0] == pytest.approx(v)
    new_base = 0.01 + 0.5 * v
    assert [x * 0.01 for x in res.multipliers] == pytest.approx([new_base * m for m in mult])
    assert res.winner == 2
    # second vote: momentum carries the old velocity
    res2 = rule.explore(Ballot(0, [1.0, 1.0, 1.0], res.multipliers, [True] * 3, 0.01, True), G().manual_seed(0))
    assert rule.velocity[0] == pytest.approx(0.9 * v)
    # the lowest-LR group winning moves the base down
    rule2 = Softmax(permute=False)
    res3 = rule2.explore(Ballot(0, [0.8, 0.9, 1.0], mult, [True] * 3, 0.01, True), G().manual_seed(0))
    assert sum(res3.multipliers) / 3 < 1.0
    assert res2.weights == pytest.approx([1 / 3] * 3)


def test_softmax_permutation_preserves_the_set():
    rule = Softmax(meta_lr=0.0)
    mult = [0.8, 0.9, 1.1, 1.2]
    gen = G().manual_seed(3)
    seen = set()
    for _ in range(10):
        res = rule.explore(Ballot(0, [1.0, 1.0, 1.0, 1.0], mult, [True] * 4, 0.1, True), gen)
        assert sorted(res.multipliers) == pytest.approx(sorted(mult))
        assert len(set(res.multipliers)) == 4  # every group a distinct multiplier
        seen.add(tuple(res.multipliers))
        mult = res.multipliers
    assert len(seen) > 1  # permutations actually change the assignment


def test_softmax_is_guarded_against_non_positive_lr():
    rule = Softmax(meta_lr=1e6, permute=False)  # absurd meta LR: the additive update would go negative
    res = rule.explore(Ballot(0, [0.1, 0.2, 5.0], [0.5, 1.0, 100.0], [True] * 3, 0.01, True), G().manual_seed(0))
    base = 0.01 * (0.5 + 1.0 + 100.0) / 3
    new_base = 0.01 * sum(res.multipliers) / 3
    assert new_base == pytest.approx(base / 2)
    assert all(m > 0 and math.isfinite(m) for m in res.multipliers)


def test_no_move_before_warmup_or_with_zero_schedule():
    rule = Softmax()
    mult = [0.5, 1.5]
    assert rule.explore(Ballot(0, [1.0, 0.5], mult, [True, True], 0.01, False), G()).multipliers == mult
    assert rule.explore(Ballot(0, [1.0, 0.5], mult, [True, True], 0.0, True), G()).multipliers == mult


def test_best_vote_recentres_and_keeps_spread():
    rule = Best(shrink=0.5, min_spread=0.05)
    mult = [1.0, 0.5, 0.1, 5.0]
    gen = G().manual_seed(0)
    spreads = []
    for _ in range(8):
        res = rule.explore(Ballot(0, [0.9, 0.5, 1.2, 3.0], mult, [True] * 4, 0.001, True), gen)
        assert res.winner == 1 and res.weights == [0.0, 1.0, 0.0, 0.0]
        assert res.multipliers[1] == pytest.approx(mult[1])  # the winner keeps its LR
        logs = sorted(math.log(m / res.multipliers[1]) for m in res.multipliers)
        gaps = [b - a for a, b in zip(logs, logs[1:])]
        assert min(gaps) > 0  # variation kept: all distinct
        spreads.append(rule.spread[0])
        mult = res.multipliers
    assert spreads == sorted(spreads, reverse=True)
    assert spreads[-1] == pytest.approx(0.05)  # floor reached, never zero
    initial = (math.log(5.0) - math.log(0.1)) / 2
    assert spreads[0] == pytest.approx(initial * 0.5)


def test_winner_and_divergence_rules():
    assert winner_of([1.0, 0.5, 0.5], [True, True, True]) == 1
    assert winner_of([1.0, 0.5], [False, False]) == -1
    assert divergent([1.0, float("nan"), 2.5, 3.5], [True] * 4, 3.0) == [False, True, False, True]
    assert divergent([1.0, 1.0], [True, False], None) == [False, True]
    assert divergent([-1.0, 5.0], [True, True], 3.0) == [False, False]  # ratio rule only for positive losses


def test_rule_state_round_trip():
    rule = Softmax()
    rule.explore(Ballot(0, [1.0, 0.5], [0.5, 1.5], [True, True], 0.1, True), G().manual_seed(0))
    other = Softmax()
    other.load_state_dict(rule.state_dict())
    assert other.velocity == rule.velocity and other.shape == rule.shape
    best = Best()
    best.explore(Ballot(0, [1.0, 0.5], [0.5, 1.5], [True, True], 0.1, True), G().manual_seed(0))
    copy = Best()
    copy.load_state_dict(best.state_dict())
    assert copy.spread == best.spread


def test_a_name_gives_the_rule_with_its_defaults_and_an_unknown_name_is_refused():
    assert as_vote("softmax") == Softmax() and as_vote("best") == Best() and set(VOTES) >= {"softmax", "best"}
    with pytest.raises(ValueError, match="`vote` must be one of"):
        as_vote("median")


def test_a_fresh_copy_keeps_the_options_and_drops_the_state():
    """The controller runs ``vote.fresh()``: one object may configure many runs (or every rank of a FakeWorld)."""
    rule = Softmax(temperature=0.5)
    rule.explore(Ballot(0, [1.0, 0.5], [0.5, 1.5], [True, True], 0.1, True), G().manual_seed(0))
    fresh = rule.fresh()
    assert fresh == rule and fresh.temperature == 0.5 and rule.velocity and not fresh.velocity
