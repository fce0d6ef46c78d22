"""HDET's defaults fit the job and the run (issue 39): groups from the world size, a grid that always trains the
user's LR, a vote interval sized to the run. Pure functions in one process against hand-computed values; the Trainer
path on 1, 2 and 4 processes (gloo)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.hdet.hyperparams import initial_multipliers
from lightning_hdet.hdet.layout import GroupLayout, make_layout
from lightning_hdet.hdet.lightning.callback import vote_plan
from lightning_hdet.hdet.lightning.monitor import validation_plan
from lightning_hdet.hdet.rules.defaults import (
    default_num_groups,
    lone_ranks_warning,
    span_grid,
    user_group,
    validation_aligned_interval,
    vote_interval,
)
from tests.helpers import START, LinearModel, Recorder, SGDBoring, load_ranks, trainer_kwargs


# ------------------------------------------------------------------ the grid: the user's LR always trains
@pytest.mark.parametrize(("groups", "span", "expected"), [
    (1, 27.0, [1.0]),
    (2, 16.0, [1.0, 4.0]),  # the user's LR and a probe above it (span ** 0.5)
    (3, 16.0, [0.25, 1.0, 4.0]),  # odd: symmetric, as before
    (4, 16.0, [0.5, 1.0, 2.0, 4.0]),  # the 5-point grid 0.25 .. 4 without its lowest point
    (4, 27.0, [27 ** -0.25, 1.0, 27 ** 0.25, 27 ** 0.5]),  # the default with four groups: 0.44, 1, 2.28, 5.2
    (6, 64.0, [2 ** -2, 2 ** -1, 1.0, 2.0, 4.0, 8.0]),  # neighbours 64 ** (1/6) = 2 apart, lowest point dropped
])
def test_the_grid_holds_the_users_lr_and_stays_within_the_span(groups, span, expected):
    grid = span_grid(groups, span)
    assert grid == pytest.approx(expected)
    assert grid[user_group(groups)] == 1.0  # exactly: the group trains the optimizer's own LR
    assert span ** -0.5 - 1e-12 <= min(grid) and max(grid) <= span ** 0.5 + 1e-12


def test_explored_spans_hold_the_users_value_in_the_users_group():
    """Every explored span's grid holds 1 too, in the group that trains the user's LR, so the user's whole set-up
    trains; the k-th name after the LR rotates the other values over the other groups by k."""
    assert initial_multipliers(16.0, 2, 1) == pytest.approx([1.0, 4.0])
    assert initial_multipliers(16.0, 3, 1) == pytest.approx([4.0, 1.0, 0.25])  # the others swapped: not rising along
    assert initial_multipliers(16.0, 4, 1) == pytest.approx([2.0, 1.0, 4.0, 0.5])
    assert initial_multipliers(16.0, 4, 2) == pytest.approx([4.0, 1.0, 0.5, 2.0])
    assert initial_multipliers(16.0, 4, 3) == pytest.approx(span_grid(4, 16.0))  # a full turn of the three others
    assert initial_multipliers([3.0, 2.0], 2, 1) == [3.0, 2.0]  # a list: as given


# ------------------------------------------------------------------ groups from the world size
@pytest.mark.parametrize(("world", "groups"), [
    (1, 1), (2, 2), (3, 3), (4, 4), (6, 3), (8, 4), (9, 3), (10, 2), (12, 4), (16, 4), (64, 4), (5, 5), (7, 7),
])
def test_the_default_number_of_groups_follows_the_world_size(world, groups):
    """The largest divisor up to 4; a prime world size above 3 has none from 2 to 4: one group per rank."""
    assert default_num_groups(world) == groups
    assert make_layout(world, None, None) == GroupLayout(world, groups)


def test_what_a_64_rank_job_gets_and_what_overrides_it():
    layout = make_layout(64, None, None)
    assert (layout.num_groups, layout.group_size, layout.ranks(1)) == (4, 16, list(range(16, 32)))
    assert make_layout(64, 64, None).num_groups == 64  # num_groups given: honoured
    assert make_layout(8, None, [0.5, 1.0]).num_groups == 2  # one group per multiplier given


def test_the_trainer_strategies_take_the_default_groups_and_the_published_one_keeps_one_per_rank():
    """Built as a user builds them (no process starts): 8 CPU processes give "hdet" four groups of two ranks; the
    paper's set-up keeps its one member per rank."""
    recommended = Trainer(strategy="hdet", accelerator="cpu", devices=8, logger=False).strategy
    assert (recommended.layout.num_groups, recommended.layout.group_size) == (4, 2)
    assert recommended.lr_multipliers[:, 0].tolist() == pytest.approx(span_grid(4, 27.0))
    published = Trainer(strategy="hdet_published", accelerator="cpu", devices=8, logger=False).strategy
    assert (published.layout.num_groups, published.layout.group_size) == (8, 1)


def test_the_lone_ranks_warning_names_only_sizes_whose_groups_hold_several_ranks():
    """5 ranks: 4 would be four groups of one again, so only 6 is named; 7: 6 and 8; no warning where a count from 2
    to 4 divides the world size, or up to 4 ranks."""
    assert "Run on 6 processes" in lone_ranks_warning(5)
    assert "Run on 10 or 12 processes" in lone_ranks_warning(11)
    assert [w for w in range(1, 14) if lone_ranks_warning(w)] == [5, 7, 11, 13]


def test_a_prime_world_size_above_four_warns_that_every_rank_is_its_own_group():
    """7 ranks: no count from 2 to 4 divides 7, so 7 groups of one rank, said with the fix; 6 ranks, a given
    `num_groups` or given multipliers do not warn."""
    with pytest.warns(UserWarning, match=r"divides the world size 7, so each of its 7 ranks is its own HDET group.*"
                                         r"Run on 6 or 8 processes.*`num_groups=7`"):
        strategy = Trainer(strategy="hdet", accelerator="cpu", devices=7, logger=False).strategy
    assert strategy.layout.num_groups == 7
    for kwargs, devices in (({}, 6), ({"num_groups": 7}, 7), ({"lr_multipliers": [1.0] * 7}, 7)):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*its own HDET group")
            Trainer(strategy=HDETStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


# ------------------------------------------------------------------ the vote interval
@pytest.mark.parametrize(("run_steps", "every"), [
    (None, 100),  # unknown length: the fallback
    (8, 5), (36, 5),  # floor: at least MIN_INTERVAL steps per vote (36 / 4 / 2 = 4.5)
    (60, 8),  # 60 / 4 / 2 = 7.5 rounds to even
    (128, 16),  # 128 / 4 / 2 = 16
    (300, 38),  # 300 / 8 = 37.5 rounds to even
    (1000, 100), (100_000, 100),  # ceiling: the 0.x default (1000 / 8 = 125)
])
def test_the_default_interval_is_sized_to_the_run(run_steps, every):
    assert vote_interval(run_steps) == every


@pytest.mark.parametrize(("every", "period", "aligned"), [
    (38, 30, 30),  # issue 59's cells: 38 / 30 = 1.27 -> one validation interval, votes at 30, 60, 90, ...
    (38, 10, 40),  # 3.8 -> 4
    (38, 20, 40),  # 1.9 -> 2
    (38, 76, 76),  # validation rarer than the votes (monitor="auto" reads it up to 2 intervals apart): one
    (45, 30, 60),  # 1.5, a tie: the longer interval
    (100, 1, 100), (16, 16, 16),  # already a multiple
    (38, 7.5, 38), (38, 0, 38),  # no whole-step grid: as sized
])
def test_a_sized_interval_moves_to_the_nearest_multiple_of_the_validation_interval(every, period, aligned):
    assert validation_aligned_interval(every, period) == aligned


def test_votes_on_validation_say_the_interval_moved_and_warn_once_for_a_given_one_off_the_grid():
    every, line, warning = validation_plan(None, 38, 30.0, "val_loss")
    assert (every, warning) == (30, "")
    assert "a vote every 30 steps from step 60 (sized to the run: every 38)" in line
    assert "validation interval (30 steps)" in line
    assert validation_plan(None, 38, None, "val_loss") == (38, "", "")  # not validated by steps: nothing to align to
    assert validation_plan(None, 60, 30.0, "val_loss") == (60, "", "")  # on the grid already: nothing to say
    every, line, warning = validation_plan(38, 38, 30.0, "val_loss")  # given: honoured, with the fix
    assert (every, line) == (38, "")
    assert "HDETCallback(every_n_steps=38) votes on `val_loss`" in warning and "every 30 optimizer steps" in warning
    assert "a multiple of 30 (e.g. 30)" in warning
    assert validation_plan(60, 60, 30.0, "val_loss") == (60, "", "")


def test_a_run_too_short_for_two_votes_warns_with_the_numbers_and_a_given_interval_is_honoured():
    assert vote_plan(None, 300) == (38, None)
    assert vote_plan(None, None) == (100, None)  # nothing to compare with
    assert vote_plan(7, 300) == (7, None)  # given: honoured
    every, warning = vote_plan(100, 60)  # the case: 0 votes in 60 steps at the old default
    assert every == 100
    assert "60 optimizer steps holds 0 vote(s)" in warning and "every_n_steps=100" in warning
    assert "smaller `every_n_steps`" in warning and "2 x 100 = 200 steps" in warning
    every, warning = vote_plan(None, 8)
    assert every == 5 and "holds 1 vote(s)" in warning and "shortest default interval (5 steps)" in warning
    assert "Train for more steps" in warning
    assert vote_plan(None, 10) == (5, None)  # exactly two votes: no warning


# ------------------------------------------------------------------ the Trainer path
class _Seen(Callback):
    """What the HDETCallback chose, per rank: its interval and the step its search ended at."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        (hdet,) = [cb for cb in trainer.callbacks if isinstance(cb, HDETCallback)]
        torch.save({"every": hdet.every_n_steps, "searched_at": hdet.controller.searched_at,
                    "config": hdet.config["every_n_steps"]}, self.out / f"seen{trainer.global_rank}.pt")


@pytest.mark.timeout(300)
def test_a_60_step_run_on_2_processes_votes_in_and_after_the_search_and_trains_the_users_lr(tmp_path):
    """The issue's case: ``Trainer(strategy="hdet", devices=2, max_steps=60)`` voted 0 times at the old interval
    of 100. Now: a vote every 8 steps, the search ending at the first vote from step 15 on, votes after it, and group
    0 training the user's own LR from the first step (group 1 the probe at 5.2x)."""
    seed_everything(0)
    trainer = Trainer(strategy=HDETStrategy(start_method=START), callbacks=[Recorder(tmp_path), _Seen(tmp_path)],
                      **trainer_kwargs(devices=2, max_steps=60))
    trainer.fit(LinearModel(lr=0.1, optimizer="adam"))  # Adam's good LR on this least squares (test_insurance_fit)
    ranks, seen = load_ranks(tmp_path, 2), torch.load(tmp_path / "seen0.pt")
    assert (seen["every"], seen["config"]) == (8, 8)
    votes = sorted({h["step"] for h in ranks[0]["history"]})
    assert votes[:7] == list(range(8, 57, 8))  # then the final merge where the run ends, at step 60
    assert seen["searched_at"] == 16  # the first vote from step 15 on ends the search
    assert len([v for v in votes if v > seen["searched_at"]]) >= 5  # and votes go on after it
    first_lrs = [r["effective_lrs"][0][0] for r in ranks]  # what each group's first optimizer step applied
    assert first_lrs == pytest.approx([0.1, 0.1 * 27 ** 0.5])


@pytest.mark.timeout(300)
def test_four_processes_get_the_world_sizes_groups_and_one_trains_the_users_lr(tmp_path):
    """On 4 processes: ``default_num_groups(4)`` groups of one rank on the default grid; group ``user_group(4)``
    trains the optimizer's LR itself."""
    seed_everything(0)
    trainer = Trainer(strategy=HDETStrategy(start_method=START), callbacks=[HDETCallback(every_n_steps=4),
                      Recorder(tmp_path)], **trainer_kwargs(devices=4, max_steps=4))
    trainer.fit(SGDBoring(lr=0.01))
    ranks = load_ranks(tmp_path, 4)
    assert [(r["num_groups"], r["group_ranks"]) for r in ranks] == [(4, [g]) for g in range(4)]
    first_lrs = [r["effective_lrs"][0][0] for r in ranks]
    assert first_lrs == pytest.approx([0.01 * m for m in span_grid(4, 27.0)])
    assert first_lrs[user_group(4)] == pytest.approx(0.01)


def test_a_run_bounded_by_epochs_is_sized_from_lightnings_estimate(tmp_path):
    """``max_epochs`` and no ``max_steps``: the interval is sized at train start from the optimizer steps Lightning
    estimates (BoringModel: 64 batches an epoch, 2 epochs = 128 steps -> 16); one process, one group."""
    seed_everything(0)
    with pytest.warns(UserWarning, match="needs several data-parallel replicas"):
        trainer = Trainer(strategy=HDETStrategy(start_method=START), callbacks=[HDETCallback(), _Seen(tmp_path)],
                          **trainer_kwargs(devices=1, max_steps=-1, max_epochs=2))
    trainer.fit(SGDBoring())
    seen = torch.load(tmp_path / "seen0.pt")
    assert seen["every"] == seen["config"] == vote_interval(128) == 16
