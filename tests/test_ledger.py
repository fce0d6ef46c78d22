"""The vote ledger on its own: rows, counters and checkpoints, against hand-computed values."""

from __future__ import annotations

import math

import torch

from lightning_hdet.hdet.rules.controller import Decision, Interval
from lightning_hdet.hdet.rules.ledger import VoteLedger


def _vote(step: int, lrs: list[float], rescued: list[bool], roll_back: bool = False,
          final: bool = False) -> tuple[Decision, Interval]:
    losses = [1.0, 2.0]
    table = torch.ones(2, 1, dtype=torch.float64)
    decision = Decision(step, losses, [0.75, 0.25], 0, table, lrs, rescued, roll_back)
    return decision, Interval(step, losses, [True, True], table, [0.1], False, final=final)


def test_trained_lr_is_the_initial_lr_then_what_the_vote_before_set():
    ledger = VoteLedger()
    ledger.initial_lrs = [0.1, 0.2]
    ledger.record(*_vote(10, [0.15, 0.3], [False, False]), edge=0, clear=True)
    ledger.record(*_vote(20, [0.05, 0.4], [False, True]), edge=1, clear=None)
    assert [(r["step"], r["group"], r["lr"], r["trained_lr"]) for r in ledger.history] == [
        (10, 0, 0.15, 0.1), (10, 1, 0.3, 0.2), (20, 0, 0.05, 0.15), (20, 1, 0.4, 0.3)]
    assert [(r["clear"], r["edge"], r["rescued"], r["weight"]) for r in ledger.history[::2]] == [
        (1, 0, False, 0.75), ("", 1, False, 0.75)]
    assert (ledger.rescues, ledger.num_votes, ledger.last_winner) == (1, 2, 0)


def test_the_final_merge_counts_as_a_vote_only_at_a_roll_back_and_unknown_initial_lrs_are_nan():
    ledger = VoteLedger()
    ledger.record(*_vote(30, [0.1, 0.1], [False, False], final=True), edge=0, clear=None)
    assert ledger.num_votes == 0 and all(math.isnan(r["trained_lr"]) for r in ledger.history)
    ledger.record(*_vote(31, [0.1, 0.01], [False, True], roll_back=True, final=True), edge=0, clear=None)
    assert ledger.num_votes == 1 and ledger.rescues == 1


def test_checkpoint_keys_and_an_older_checkpoint_without_trained_lr_or_initial_lrs():
    ledger = VoteLedger()
    assert list(ledger.state_dict()) == ["history", "rescues", "num_votes", "last_winner"]  # no initial_lrs yet
    ledger.initial_lrs = [0.1, 0.2]
    ledger.record(*_vote(10, [0.15, 0.3], [True, False]), edge=0, clear=None)
    restored = VoteLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.state_dict() == ledger.state_dict()
    old = [{"step": s, "group": g, "lr": lr} for s, g, lr in [(10, 0, 0.5), (10, 1, 0.7), (20, 0, 0.6), (20, 1, 0.8)]]
    restored.load_state_dict({"history": old, "rescues": 2, "num_votes": 2, "last_winner": 1})
    trained = [r["trained_lr"] for r in restored.history]
    assert math.isnan(trained[0]) and math.isnan(trained[1]) and trained[2:] == [0.5, 0.7]
    assert (restored.initial_lrs, restored.rescues, restored.num_votes, restored.last_winner) == ([], 2, 2, 1)
