"""What HDET hands back (lightning_hdet/hdet/result.py) and how its console lines spell numbers (console.py)."""

from __future__ import annotations

import pytest

from lightning_hdet.hdet.console import counted, rounded_list
from lightning_hdet.hdet.result import make_result, vote_line


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


def test_console_lines_round_and_count() -> None:
    assert vote_line(300, 1, [0.123456789, 0.5], [0.0012345678, 0.002]) == (
        "HDET: vote at step 300: group 1 won (loss 0.5); losses [0.1235, 0.5]; LRs [0.001235, 0.002]")
    assert "no group was healthy" in vote_line(3, -1, [float("nan")], [0.1], final=True)
    assert rounded_list([float("inf"), 2.0]) == "[inf, 2]"
    assert [counted(1, "rank"), counted(4, "rank")] == ["1 rank", "4 ranks"]
