"""What HDET hands back (lightning_hdet/hdet/result.py) and how its console lines spell numbers (console.py)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from lightning_hdet._text import counted
from lightning_hdet.hdet.console import rounded_list
from lightning_hdet.hdet.result import failed_groups, make_result, vote_line


def _rows(step: int, winner: int, losses: list[float]) -> list[dict]:
    return [{"step": step, "group": g, "lr": 0.1, "loss": loss, "weight": 0.0, "winner": winner, "rescued": False}
            for g, loss in enumerate(losses)]


def test_result_takes_the_last_winners_lrs_and_counts_each_vote_once() -> None:
    history = _rows(100, 1, [0.5, 0.4, 0.9]) + _rows(200, 2, [0.4, 0.35, 0.3])
    table = [[0.01, 0.001], [0.02, 0.002], [0.04, 0.004]]  # 3 groups x 2 param groups
    result = make_result(history, table, [0.01, 0.02, 0.04], votes=2, rescues=1, searched_at=None,
                         vote_history=["/run/vote_history.csv"])
    assert result.winners == [(100, 1), (200, 2)]
    assert result.lrs == [0.04, 0.004]  # the last winner's row, every param group
    summary = result.summary()
    assert "2 vote(s), 1 rescue(s)" in summary and "group 1 x1, group 2 x1" in summary
    assert "[0.04, 0.004]" in summary and "/run/vote_history.csv" in summary


def test_result_without_a_healthy_winner_reports_the_groups_mean() -> None:
    result = make_result(_rows(10, -1, [float("nan")] * 2), [[0.1], [0.3]], [0.1, 0.3], 1, 2, 10, [])
    assert result.lrs == pytest.approx([0.2])
    assert "search ended at step 10" in result.summary() and "not written" in result.summary()
    assert "initial model" not in result.summary()
    assert "winners: no healthy group x1;" in result.summary()  # the -1 sentinel is not shown as a group
    restarted = make_result(_rows(10, 0, [0.4, 0.5]), [[0.1], [0.3]], [0.1, 0.3], 1, 0, 10, [], restarted_at=10)
    assert restarted.summary().splitlines()[0] == ("HDET result: 1 vote(s), 0 rescue(s), search ended at step 10 and "
                                                   "restarted every group from the initial model")


def test_the_result_counts_the_plateau_ladders_and_says_what_a_slow_start_looks_like() -> None:
    """Rows whose reason is "plateau" mark a ladder (benchmark 2's shapes from 10x too high: every group at step 64);
    a vote where only some groups were caught for another reason is not one."""
    history = _rows(32, 0, [1.8, 1.8]) + _rows(64, -1, [1.79, 1.8]) + _rows(96, 1, [1.79, 1.7])
    for row in history[2:4]:
        row["reason"] = "plateau"
    history[4]["reason"] = "stalled"
    result = make_result(history, [[0.001], [0.0001]], [0.02, 0.05], 3, 2, 32, [])
    assert result.ladders == [64] and result.to_dict()["ladders"] == [64]
    assert ("the plateau rule moved every group onto 10-100x lower LRs at step(s) 64" in result.summary())
    assert "plateau rule" not in make_result(_rows(32, 0, [1.8, 1.8]), [[0.02]] * 2, [0.02] * 2, 1, 0, None,
                                             []).summary()


def test_a_run_without_a_vote_says_what_it_was() -> None:
    """No vote (the run shorter than the interval): the summary says so and what trained, never "LRs found"."""
    table = [[0.02], [0.08]]
    result = make_result(_rows(60, 1, [0.5, 0.4]), table, [0.02, 0.08], votes=0, rescues=0, searched_at=None,
                         vote_history=[], steps=60, every_n_steps=100, gradient_sync="group")
    summary = result.summary()
    assert "no vote in 60 step(s) (a vote every 100 steps)" in summary
    assert "one plain DDP run per group, each at its starting LR ([0.02, 0.08])" in summary
    assert "final merge at step 60" in summary and "LRs found" not in summary
    shared = make_result([], table, [0.02, 0.08], 0, 0, None, [], steps=60, every_n_steps=100,
                         gradient_sync="global").summary()
    assert "plain DDP on one shared gradient" in shared and "final merge" not in shared
    voted = make_result(_rows(100, 1, [0.5, 0.4]), table, [0.02, 0.08], 1, 0, None, [], steps=100).summary()
    assert "no vote" not in voted and "LRs found" in voted


def test_the_result_exports_a_plain_dict_and_one_row_per_vote_and_group() -> None:
    history = _rows(100, 1, [0.5, 0.4]) + _rows(200, 0, [0.3, 0.35])
    result = make_result(history, [[0.01], [0.02]], [0.01, 0.02], 2, 0, 100, ["/run/vote_history.csv"], steps=250,
                         every_n_steps=100, gradient_sync="global", ties=1)
    plain = result.to_dict()
    assert json.loads(json.dumps(plain)) == plain  # plain values only
    assert plain["winners"] == [{"step": 100, "group": 1}, {"step": 200, "group": 0}]
    assert (plain["lrs"], plain["steps"], plain["ties"], plain["searched_at"]) == ([0.01], 250, 1, 100)
    rows = result.to_rows()
    assert [(r["step"], r["group"], r["loss"], r["winner"]) for r in rows] == [
        (100, 0, 0.5, 1), (100, 1, 0.4, 1), (200, 0, 0.3, 0), (200, 1, 0.35, 0)]
    rows[0]["loss"] = 9.0  # a copy: the result is not changed through it
    assert result.to_rows()[0]["loss"] == 0.5
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(result.to_rows())
    assert out.getvalue().splitlines()[0] == "step,group,lr,loss,weight,winner,rescued"
    assert "1 vote(s) saw one monitored value for every group" in result.summary()


def test_console_lines_round_and_count() -> None:
    assert vote_line(300, 1, [0.123456789, 0.5], [0.0012345678, 0.002]) == (
        "HDET: vote at step 300: group 1 won (loss 0.5); losses [0.1235, 0.5]; LRs now [0.001235, 0.002]")
    assert "no group was healthy" in vote_line(3, -1, [float("nan")], [0.1], final=True)
    assert rounded_list([float("inf"), 2.0]) == "[inf, 2]"
    assert [counted(1, "rank"), counted(4, "rank")] == ["1 rank", "4 ranks"]
    # the rescued groups, each reason once (a ladder fails every group for the same reason)
    assert failed_groups([True] * 4, ["plateau"] * 4) == "groups 0, 1, 2, 3 (plateau)"
    assert failed_groups([True, True, True, False], ["x best", "non-finite", "x best", ""]) == (
        "groups 0, 2 (x best) and group 1 (non-finite)")
    assert failed_groups([False, True], []) == "group 1"


def _marked(step: int, winner: int, losses: list[float], edge: int, clear: object) -> list[dict]:
    rows = _rows(step, winner, losses)
    for row in rows:
        row.update(edge=edge, clear=clear)
    return rows


def test_the_result_says_where_the_best_lr_likely_is_and_which_lr_to_use_in_a_plain_run() -> None:
    """The highest LR won the last two votes: the summary points above the highest LR at the end; the LR for a plain
    run is the last winner's. The lowest edge points below the lowest; one edge win or an inside win says neither."""
    table = [[0.01], [0.02], [0.04]]
    up = make_result(_marked(10, 2, [0.5, 0.4, 0.3], 1, 1) + _marked(20, 2, [0.4, 0.3, 0.2], 1, 1), table,
                     [0.01, 0.02, 0.04], votes=3, rescues=0, searched_at=None, vote_history=[])
    assert up.edges == [1, 1] and up.edge_run() == 1
    assert "your best LR is likely above 0.04" in up.summary()
    assert "for a plain run (one LR, e.g. DDP) use lr=[0.04]" in up.summary()
    down = make_result(_marked(10, 0, [0.1, 0.4, 0.5], -1, 1) + _marked(20, 0, [0.1, 0.3, 0.5], -1, 1), table,
                       [0.01, 0.02, 0.04], 3, 0, None, [])
    assert "your best LR is likely below 0.01" in down.summary()
    for edges in ((1, 0), (-1, 1), (0, 0)):
        mixed = make_result(_marked(10, 0, [0.1, 0.4], edges[0], 1) + _marked(20, 0, [0.1, 0.3], edges[1], 1),
                            table[:2], [0.01, 0.02], 3, 0, None, [])
        assert mixed.edge_run() == 0 and "likely" not in mixed.summary()


def test_the_result_says_when_the_votes_were_within_noise_or_too_few() -> None:
    """Half the judged votes or more within noise: said, with the fix; votes with no judgement ("") not counted."""
    table = [[0.01], [0.02]]
    noisy = make_result(_marked(10, 0, [0.3, 0.31], 0, 0) + _marked(20, 1, [0.3, 0.29], 0, 1)
                        + _marked(30, 1, [0.3, 0.3], 0, ""), table, [0.01, 0.02], 3, 0, None, [])
    assert (noisy.unclear, noisy.judged) == (1, 2)
    assert "1 of 2 votes were within noise" in noisy.summary()
    decided = make_result(_marked(10, 0, [0.1, 0.31], 0, 1) + _marked(20, 0, [0.1, 0.29], 0, 1), table,
                          [0.01, 0.02], 3, 0, None, [])
    assert "within noise" not in decided.summary() and "too few" not in decided.summary()
    short = make_result(_marked(10, 0, [0.1, 0.31], 0, 1), table, [0.01, 0.02], 1, 0, None, [])
    assert "only 1 vote(s): too few to search" in short.summary()


def test_the_result_says_what_the_votes_read() -> None:
    table = [[0.01], [0.02]]
    assert "the votes read each group's `val_loss`" in make_result(
        _rows(10, 0, [0.1, 0.2]), table, [0.01, 0.02], 1, 0, None, [], monitor="val_loss").summary()
    assert "the votes read each group's training loss" in make_result(
        _rows(10, 0, [0.1, 0.2]), table, [0.01, 0.02], 1, 0, None, []).summary()


def test_votes_on_a_monitored_metric_say_the_last_winners_lead_for_want_of_a_noise_estimate() -> None:
    """No standard error comes with `val_loss`: the summary gives the margin (2.0 against 2.001: 0.05 %), leaving
    out a rescued group (1.5), rather than saying nothing about noise."""
    table = [[0.01], [0.02], [0.04]]
    history = _rows(10, 0, [2.0, 2.2, 2.3]) + _rows(20, 1, [2.001, 2.0, 1.5])
    history[-1]["rescued"] = True
    summary = make_result(history, table, [0.01, 0.02, 0.04], 2, 1, None, [], monitor="val_loss").summary()
    assert "the last vote's winner led the next group by 0.05 % of its value" in summary
    assert "led the next group" not in make_result(history, table, [0.01, 0.02, 0.04], 2, 1, None, []).summary()
