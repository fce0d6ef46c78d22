"""HDETCallback's votes, merges, rescues, roll-backs and the search's end in one process, over
:class:`lightning_hdet.testing.FakeWorld` (every group's parameters as a row of one tensor), against values computed
by hand; then the vote rules and the collapse-aware safety net on real (least-squares, ReLU MLP) training. The
collectives themselves, the guard, checkpoints and the launchers are tested with several processes
(test_callback.py, test_strategy.py, test_spawn.py, test_hdet_fsdp.py, test_reliability.py)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_hdet import PBT, Best, HDETCallback, SafetyNet, Search, Softmax
from lightning_hdet.experimental import PartialMerge
from lightning_hdet.hdet.layout import fan_out
from lightning_hdet.testing import FakeWorld
from tests.helpers import Regression

pytestmark = pytest.mark.timeout(60)


def _drift(losses):
    """A training step: group ``g``'s parameter grows by ``g + 1`` and the step's loss is ``losses(g, step)``."""

    def step(executor, index):
        executor.params.add_(executor.group_index + 1)
        return losses(executor.group_index, index)

    return step


def _falling(g, step):
    """Every group starts at 2.0 and falls, group g by 0.1 (g + 1) per step: the highest index learns fastest."""
    return 2.0 - 0.1 * (g + 1) * step


def _callback(**kw):
    """One fresh callback per group, as every rank builds its own (no search unless asked)."""
    return lambda: HDETCallback(**{"search": False, **kw})


def test_softmax_moves_the_base_lr_and_every_group_lands_on_the_mean():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Softmax(temperature=1.0, momentum=0.5, meta_lr=1.0,
                                                                   permute=False)), _drift(_falling), max_steps=4)
    # interval means over steps 0-3: 2 - 0.1 (g + 1) * 1.5
    losses = [1.85, 1.7]
    assert [h["loss"] for h in cb.history] == pytest.approx(losses)
    w1 = math.exp(0.075) / (math.exp(0.075) + math.exp(-0.075))  # softmax((mean - L) / T), T = 1
    assert [h["weight"] for h in cb.history] == pytest.approx([1 - w1, w1])
    # the controller: delta = sum w lr - mean lr, velocity (1 - momentum) delta, base LR 0.15 -> 0.15 + meta_lr v
    delta = (1 - w1) * 0.1 + w1 * 0.2 - 0.15
    base = 0.15 + 0.5 * delta
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([base / 0.15, 2 * base / 0.15])
    # params 4 and 8 at the vote, both to the mean; the vote was good (below the start): the mean is the restore point
    assert world.params.flatten().tolist() == [6.0, 6.0]
    assert world.restore_point.tolist() == [6.0] and world.restarts == [0, 0]


def test_a_partial_weighted_merge_then_the_final_merge_at_full_strength():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    vote = PartialMerge(Softmax(blend="weighted", temperature=1.0, meta_lr=0.0, permute=False), strength=0.5)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=vote), _drift(_falling), max_steps=4)
    w1 = math.exp(0.075) / (math.exp(0.075) + math.exp(-0.075))
    target = (1 - w1) * 4 + w1 * 8
    after_vote = [0.5 * 4 + 0.5 * target, 0.5 * 8 + 0.5 * target]  # theta <- (1 - s) theta + s target
    final = (1 - w1) * after_vote[0] + w1 * after_vote[1]  # nothing trained since: the same weights, strength 1
    assert world.params.flatten().tolist() == pytest.approx([final, final])
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 2.0])  # meta_lr 0: no LR moved


def test_pbt_copies_the_best_group_into_the_worst_only():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0, 4.0], num_groups=4)
    callback = _callback(every_n_steps=4, vote=PBT(quantile=0.25, resample_probability=0.0))
    world.fit(callback, _drift(_falling), max_steps=5)  # votes at 4; the end of fit merges on the best group
    # at step 4 the params are 4, 8, 12, 16: group 0 (the worst) copied group 3 (the best), then each grew once more
    assert world.table.get(1)[1:, 0].tolist() == [2.0, 3.0, 4.0]
    assert float(world.table.get(1)[0, 0]) in (pytest.approx(0.8 * 4.0), pytest.approx(1.2 * 4.0))
    # final merge on the best group of steps 5 (group 3: 16 + 4 = 20): every group holds it
    assert world.params.flatten().tolist() == [20.0] * 4


def test_pbt_copy_step_by_hand():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0, 4.0], num_groups=4)
    seen = []

    def step(executor, index):
        if index == 4:
            seen.append((executor.group_index, float(executor.params)))
        return _drift(_falling)(executor, index)

    world.fit(_callback(every_n_steps=4, vote=PBT(quantile=0.25, resample_probability=0.0)), step, max_steps=5)
    assert sorted(seen) == [(0, 16.0), (1, 8.0), (2, 12.0), (3, 16.0)]  # the copy, before step 5 trained


def test_best_vote_gives_every_group_the_winners_model():
    world = FakeWorld(params=[0.0], lr_multipliers=[0.5, 2.0], num_groups=2)
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Best(blend="best", shrink=0.5)), _drift(_falling),
                           max_steps=4)
    assert cb.history[0]["winner"] == 1
    assert world.params.flatten().tolist() == [8.0, 8.0]
    # the winner keeps its LR; the other is re-centred on it at exp(2 x half the log-range x shrink)
    spread = 0.5 * (math.log(2.0) - math.log(0.5)) / 2
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([2.0 * math.exp(2 * spread), 2.0])


def test_a_diverged_group_is_rescued_from_the_healthy_groups_mean():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0, 3.0], num_groups=3)

    def step(executor, index):
        if executor.group_index == 2 and index == 2:
            executor.params.fill_(math.nan)  # a step that blew up: the guard flagged it
            world.skip(2)
            return math.nan
        return _drift(_falling)(executor, index)

    (cb, _), *_ = world.fit(_callback(every_n_steps=4, vote=Softmax(meta_lr=0.0, permute=False)), step, max_steps=4)
    assert [h["rescued"] for h in cb.history] == [False, False, True] and cb.rescues == 1
    assert world.params.flatten().tolist() == [6.0, 6.0, 6.0]  # the mean of 4 and 8; group 2 took it fully
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 2.0, 1.5])  # its LR halved (rescue_lr_factor)
    assert world.restarts == [0, 0, 1]  # and its optimizer state restarted


def _nan_from_step_2(executor, index):
    """Every group falls (``_drift(_falling)``) until step 2, then its parameters and loss are NaN."""
    if index >= 2:
        executor.params.fill_(math.nan)
        return math.nan
    return _drift(_falling)(executor, index)


def test_every_group_diverged_rolls_back_to_the_last_good_merge_and_halves_every_lr():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)

    vote = Softmax(meta_lr=0.0, permute=False)
    (cb, _), _ = world.fit(_callback(every_n_steps=2, vote=vote), _nan_from_step_2, max_steps=4)
    # vote at 2: params 2 and 4 merged to 3, a good vote (both below the start): 3 became the restore point
    # vote at 4: both NaN, every group rolled back to 3 with a fresh optimizer state and half its LR
    assert [h["winner"] for h in cb.history] == [1, 1, -1, -1]
    assert world.params.flatten().tolist() == [3.0, 3.0]
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([0.5, 1.0]) and world.restarts == [1, 1]


def test_a_roll_back_says_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    """The console line names the groups that share a reason together (it said "non-finite; non-finite")."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)

    with caplog.at_level(logging.INFO):
        world.fit(_callback(every_n_steps=2, vote=Softmax(meta_lr=0.0, permute=False)), _nan_from_step_2,
                  max_steps=4)
    assert "HDET: step 4: groups 0, 1 (non-finite) diverged; every group rolled back" in caplog.text


def test_a_blown_up_loss_under_a_shared_gradient_rolls_every_group_back_and_cuts_only_its_lr():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2, gradient_sync="global")
    losses = lambda g, step: 1e6 if g == 1 else _falling(g, step)  # noqa: E731 - finite, 10^6 x the best
    (cb, _), _ = world.fit(_callback(every_n_steps=4, vote=Softmax(meta_lr=0.0, permute=False),
                                     safety_net=SafetyNet(stall_patience=None, rise_margin=None)),
                           _drift(losses), max_steps=4)
    assert [h["rescued"] for h in cb.history] == [False, True]
    assert world.params.flatten().tolist() == [0.0, 0.0]  # back to the start: nothing of the interval is kept
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([1.0, 1.0]) and world.restarts == [1, 1]


def test_the_search_ends_on_the_winner_with_a_grid_around_its_lr_and_global_gradients():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2, gradient_sync="group")
    (cb, _), _ = world.fit(_callback(every_n_steps=2, search=Search(steps=2, refine_spread=2.0)), _drift(_falling),
                           max_steps=3)
    assert cb.controller.searched_at == 2 and world.gradient_sync == "global"
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([2.0 / 2**0.5, 2.0 * 2**0.5])
    assert world.restarts == [1, 1]  # every group's moments were gathered on another model
    # at 2 every group took the winner's model (4), then step 3 moved them by 1 and 2; the end of fit merges
    # on the best group (group 1: 6) under PBT
    assert world.params.flatten().tolist() == [6.0, 6.0]
    assert ("set_gradient_sync", "global") in world.calls


def test_a_search_ending_far_below_the_start_lr_restarts_every_group_from_the_initial_model():
    """Group 0 (x0.25) learns fastest; the search ends on it at step 2 (0.25 <= restart_below=1/3). Every group
    takes its model (2) and then the initial one (0), which becomes the restore point; the LRs are a grid of ratio
    2 around 0.25. Step 3 moves the groups by 1 and 2; the end of fit merges on the best group (group 0: 1), where
    the winner's model alone would have ended at 3."""
    world = FakeWorld(params=[0.0], lr_multipliers=[0.25, 2.0], num_groups=2, gradient_sync="group")
    (cb, _), _ = world.fit(_callback(every_n_steps=2, search=Search(steps=2, refine_spread=2.0)),
                           _drift(lambda g, step: 2.0 - 0.1 * (2 - g) * step), max_steps=3)
    assert cb.controller.searched_at == 2 and cb.controller.restarted_at == 2
    assert world.table.get(1)[:, 0].tolist() == pytest.approx([0.25 / 2**0.5, 0.25 * 2**0.5])
    assert ("restart_from_initial",) in world.calls
    assert world.params.flatten().tolist() == [1.0, 1.0]
    assert world.restarts == [2, 2]  # at the search's merge, then at the restart


@pytest.mark.parametrize("held", [True, False], ids=["held", "none-held"])
def test_a_restart_from_the_initial_model_makes_it_the_restore_point_and_changes_nothing_where_none_is_held(held):
    """From 5, the groups train to 6 and 7 and merge to 6.5 (the restore point). The restart puts every group back
    at 5, which a later roll-back returns to (not 6.5); without an initial model held nothing changes."""
    world = FakeWorld(params=[5.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    world.run(lambda executor: executor.hdet.merger.ensure_restore_point(keep_initial=held))
    world.run(lambda executor: executor.params.add_(1.0 + executor.group_index))
    world.run(lambda executor: executor.hdet.merger.merge([0.5, 0.5], [1.0, 1.0], restart=[False, False]))
    assert world.run(lambda executor: executor.hdet.merger.restart_from_initial()) == [held, held]
    assert world.params.flatten().tolist() == ([5.0, 5.0] if held else [6.5, 6.5])
    assert world.restarts == ([1, 1] if held else [0, 0])
    world.run(lambda executor: executor.params.add_(3.0))
    world.run(lambda executor: executor.hdet.merger.restore())
    assert world.params.flatten().tolist() == ([5.0, 5.0] if held else [6.5, 6.5])


@pytest.mark.parametrize("held", [True, False], ids=["held", "none-held"])
def test_the_flagged_groups_restart_from_the_initial_model_and_the_others_keep_theirs(held):
    """From 5 the groups train to 6 and 7; group 1, flagged (a probe below a too-high grid), takes the initial
    model (5) and restarts its optimizer, group 0 keeps 6; without an initial model held nothing changes."""
    world = FakeWorld(params=[5.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    world.run(lambda executor: executor.hdet.merger.ensure_restore_point(keep_initial=held))
    world.run(lambda executor: executor.params.add_(1.0 + executor.group_index))
    assert world.run(lambda executor: executor.hdet.merger.restart_groups([False, True])) == [held, held]
    assert world.params.flatten().tolist() == ([6.0, 5.0] if held else [6.0, 7.0])
    assert world.restarts == ([0, 1] if held else [0, 0])


def test_the_fake_holds_every_rank_to_the_same_calls():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    with pytest.raises(AssertionError, match=r"group [01] called .*set_lr_multipliers.* while group [01] called"):
        world.run(lambda executor: executor.hdet.table.set([1.0, 2.0 + executor.group_index]))
    table = world.run(lambda executor: executor.gather_group_values(torch.tensor([1.0 + executor.group_index])))
    assert table[0].tolist() == [[1.0], [2.0]] and torch.equal(table[0], table[1])


def test_a_monitored_metric_never_logged_is_an_error_naming_the_logged_ones():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    with pytest.raises(MisconfigurationException, match=r"monitor='val_los'\) found no such metric at the vote at step "
                                                        r"4\. Logged metrics: \['train_loss', 'val_loss'\]"):
        world.fit(_callback(every_n_steps=4, monitor="val_los"), _drift(_falling), max_steps=4,
                  callback_metrics={"val_loss": 1.0, "train_loss": 1.0, "hdet/mean_lr": 0.1})


def test_a_vote_on_a_validation_metric_shows_its_mean_lr_in_the_progress_bar_at_the_next_step():
    """The vote at step 4 runs after that step's validation; step 5 shows the LRs it set (log_every_n_steps=50)."""

    class Shown(HDETCallback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            super().on_train_batch_end(trainer, pl_module, *args)
            self.shown = pl_module.logged.get("hdet/mean_lr")

    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    (cb, _), _ = world.fit(lambda: Shown(every_n_steps=4, monitor="val_loss", search=False), _drift(_falling),
                           max_steps=5, validate=lambda executor, step: {"val_loss": 1.0 + executor.group_index}
                           if step == 4 else None)
    lrs = [row["lr"] for row in cb.history if row["step"] == 4]
    assert lrs[1] != 0.2 and cb.shown == pytest.approx(sum(lrs) / 2)  # group 1 lost: it moved


def test_a_misspelled_monitor_is_refused_at_the_first_validation_a_vote_waits_for_naming_the_logged_one():
    """Not at the end of the run: the validation after step 4 logged `val_loss` and no `val_los`."""
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 2.0], num_groups=2)
    with pytest.raises(MisconfigurationException, match=r"monitor='val_los'\) found no such metric at the vote at step "
                                                        r"4\. Logged metrics: \['val_loss'\]\. Did you mean 'val_loss'\?"):
        world.fit(_callback(every_n_steps=4, monitor="val_los"), _drift(_falling), max_steps=12,
                  validate=lambda executor, step: {"val_loss": 1.0} if step % 4 == 0 else None)

# ---------------------------------------------------------------------------------------------------------------
# The vote rules on a real (least-squares) problem, in one process: every group takes SGD steps on the same four
# batches of 64 in order (as every rank of a multi-process run without a distributed sampler); under
# gradient_sync="global" the groups' gradients are averaged through the executor's own collective.
DATA = Regression()


def _least_squares(global_gradients: bool = False):
    def step(executor, index):
        theta, rows = executor.params, slice(64 * (index % 4), 64 * (index % 4) + 64)
        x, y = DATA.x[rows].double(), DATA.y[rows, 0].double()
        residual = x @ theta[:8] + theta[8] - y
        grad = torch.cat([2 * x.T @ residual, 2 * residual.sum().reshape(1)]) / len(y)
        if global_gradients:
            grad = executor.gather_group_values(grad).mean(dim=0)
        theta.sub_(float(executor.current_lrs()[executor.group_index, 0]) * grad)
        return float((residual**2).mean())

    return step


def _full_loss(theta):
    return float(((DATA.x.double() @ theta[:8] + theta[8] - DATA.y[:, 0].double()) ** 2).mean())


def _grid_loss(lr: float, steps: int) -> float:
    """Plain SGD at ``lr`` from the same start: one group, no callback."""
    world = FakeWorld(params=torch.zeros(1, 9), lr_multipliers=[1.0], schedule_lrs=[lr])
    step = _least_squares()
    world.run(lambda executor: [step(executor, s) for s in range(steps)])
    return _full_loss(world.params[0])


def _winner_lr(history):
    last = [h for h in history if h["step"] == max(h["step"] for h in history)]
    return last[last[0]["winner"]]["lr"]


@pytest.mark.parametrize("vote", ["pbt", "best"])
def test_pbt_climbs_from_a_too_low_lr_where_best_stops(vote):
    """SGD from an LR 50x below the best grid LR: every vote the highest LR has the lowest loss. PBT always keeps a
    group 1.2x above its leader, so it climbs to the good LRs; ``best`` re-centres on the winner with a spread that shrinks to ``min_spread`` and stops far below."""
    steps, start = 40, 0.002
    grid = {lr: _grid_loss(lr, steps) for lr in (0.003, 0.01, 0.03, 0.1, 0.3, 0.5)}
    best_grid = min(grid, key=grid.get)
    rule = {"pbt": PBT(resample_probability=0.0), "best": Best(blend="best")}[vote]
    world = FakeWorld(params=torch.zeros(9), lr_multipliers=[0.5, 0.8, 1.25, 2.0], schedule_lrs=[start])
    runs = world.fit(_callback(every_n_steps=2, vote=rule, seed=0), _least_squares(), max_steps=steps)
    settled = _winner_lr(runs[0][0].history)
    assert all(cb.history == runs[0][0].history for cb, _ in runs)
    if vote != "best":
        assert best_grid / 4 <= settled <= best_grid * 4
    else:
        assert settled < best_grid / 4


def test_the_default_vote_climbs_from_a_too_low_learning_rate():
    """The default vote (``pbt``), every group's LR too low, one shared gradient: the leader keeps its LR, the worst
    group copies it and a mover sits x1.2 above the leader, so the LR a vote picks climbs past the start's highest
    (``softmax`` would move about 0.5 % per vote here, see docs/hdet.md)."""
    world = FakeWorld(params=torch.zeros(9), lr_multipliers=[0.25, 0.5, 0.75, 1.0], schedule_lrs=[0.01],
                      gradient_sync="global")
    (cb, _), *_ = world.fit(_callback(every_n_steps=4), _least_squares(global_gradients=True), max_steps=36)
    assert cb.vote == "pbt"
    votes = sorted({h["step"] for h in cb.history})
    winner_lr = []
    for s in votes:
        vote = [h for h in cb.history if h["step"] == s]
        assert vote[0]["winner"] == min(range(4), key=lambda g: vote[g]["loss"])  # the lowest interval loss leads
        winner_lr.append(vote[vote[0]["winner"]]["lr"])
    assert max(h["lr"] for h in cb.history if h["step"] == votes[0]) > 0.01  # a mover went above the start at once
    assert winner_lr[-1] >= 1.2 * 0.01 * (1 - 1e-9) and winner_lr[-1] > winner_lr[0]


def test_softmax_moves_the_base_lr_toward_the_better_multiplier_and_keeps_the_fan_out():
    """Under-fitting least squares with one shared gradient: the larger-LR groups reach lower loss, so the base LR
    rises vote after vote, the winner is the lowest loss, and the fan-out's shape is kept (permuted or not)."""
    for permute in (False, True):
        world = FakeWorld(params=torch.zeros(9), lr_multipliers=fan_out(4, 0.9), schedule_lrs=[0.01],
                          gradient_sync="global")
        vote = Softmax(temperature=0.5, meta_lr=5.0, momentum=0.5, permute=permute)
        (cb, _), *_ = world.fit(_callback(every_n_steps=4, vote=vote), _least_squares(global_gradients=True),
                                max_steps=16)
        votes = sorted({h["step"] for h in cb.history})
        assert votes == [4, 8, 12, 16] and len(cb.history) == 4 * 4
        base = [sum(h["lr"] for h in cb.history if h["step"] == s) / 4 for s in votes]
        assert base[0] > 0.01 and all(b > a for a, b in zip(base, base[1:]))
        for s in votes:
            vote_rows = [h for h in cb.history if h["step"] == s]
            assert vote_rows[0]["winner"] == min(range(4), key=lambda g: vote_rows[g]["loss"])
        final = world.table.get(1)[:, 0].tolist()
        assert sorted(m / (sum(final) / 4) for m in final) == pytest.approx(fan_out(4, 0.9))


def test_the_documented_example_runs():
    """docs/configuration.md's FakeWorld example, run as written (its own assert checks the merge)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = text[text.index("## `FakeWorld`"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    exec(compile(code, "docs/configuration.md", "exec"), {})


# ---------------------------------------------------------------------------------------------------------------
# The collapse-aware safety net on a real collapse, in one process: each group trains its own copy of a small ReLU
# MLP with its own AdamW (restarted whenever the world restarts that group's optimizer state).
CLASSES = 10


def _clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(CLASSES, 8, generator=g)
    y = torch.arange(1024) % CLASSES
    return centers[y] + torch.randn(1024, 8, generator=g), y


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, CLASSES))


def _adamw_on_clusters(world):
    """A training step: AdamW on the group's own MLP, shuffled batches of 64 (the same order in every group)."""
    x, y = _clusters()
    states = {}

    def step(executor, index):
        g = executor.group_index
        if g not in states or states[g][2] != world.restarts[g]:
            net = states[g][0] if g in states else _mlp()
            states[g] = (net, torch.optim.AdamW(net.parameters(), lr=1.0), world.restarts[g])
        net, optimizer, _ = states[g]
        epoch, batch = divmod(index, len(y) // 64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))[64 * batch : 64 * batch + 64]
        torch.nn.utils.vector_to_parameters(executor.params.float(), net.parameters())
        loss = torch.nn.functional.cross_entropy(net(x[order]), y[order])
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = float(executor.current_lrs()[g, 0])
        optimizer.step()
        executor.params.copy_(torch.nn.utils.parameters_to_vector(net.parameters()).detach().double())
        return float(loss.detach())

    return step


def _clusters_loss(theta):
    net, (x, y) = _mlp(), _clusters()
    torch.nn.utils.vector_to_parameters(theta.float(), net.parameters())
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(net(x), y))


@pytest.mark.parametrize("net", ["collapse", "factor only", "factor and plateau"])
def test_collapse_without_nan_rolls_back_and_cuts_the_lrs(net):
    """AdamW at LRs 1 and 2: both groups sit at ln(10) with finite losses. The ratio rule (10x the best) never
    fires; the collapse rules (on by default) see every group knocked above its first-step loss and stuck there, roll
    every group back to the last good merge (here the initial model) and halve the LRs until training works.
    Without them the plateau rule alone (no new best for 30 steps, a fifth of the 150-step run) rolls back onto a
    ladder 10-100x lower, from which it trains too."""
    safety_net = {"collapse": SafetyNet(), "factor only": SafetyNet(stall_patience=None, rise_margin=None, plateau=None),
                  "factor and plateau": SafetyNet(stall_patience=None, rise_margin=None)}[net]
    start = torch.nn.utils.parameters_to_vector(_mlp().parameters()).detach()
    world = FakeWorld(params=start, lr_multipliers=[1.0, 2.0], schedule_lrs=[1.0])
    (cb, _), _ = world.fit(_callback(every_n_steps=10, vote="best", safety_net=safety_net),
                           _adamw_on_clusters(world), max_steps=150)
    final = _clusters_loss(world.params[0])
    if net == "factor only":
        assert cb.rescues == 0 and final > 0.95 * math.log(CLASSES)  # collapsed, and nobody noticed
        return
    if net == "factor and plateau":
        cuts = sorted({h["step"] for h in cb.history if h["reason"] == "plateau"})
        assert len(cuts) == 1 and cuts[0] <= 80 and max(world.table.get(1)[:, 0].tolist()) < 0.2
        assert final < 0.7 * math.log(CLASSES)
        return
    history = cb.history
    roll_backs = [s for s in sorted({h["step"] for h in history}) if all(h["rescued"] for h in history if h["step"] == s)]
    assert len(roll_backs) >= 2 and {h["reason"] for h in history if h["rescued"]} <= {"stalled", "rose"}
    assert cb.rescues == 2 * len(roll_backs)
    assert max(world.table.get(1)[:, 0].tolist()) < 1.0  # every roll-back halved every LR
    assert math.isfinite(final) and final < 0.7 * math.log(CLASSES)  # trains again, far below the collapsed level


CHANCE = math.log(6)  # the untrained model's loss; a collapsed one sits 1 % below it (CHANCE_SHORT)
CHANCE_SHORT = 0.99
CRITICAL = 0.16  # above this LR the model collapses from step COLLAPSE_AT on
COLLAPSE_AT = 30


def _collapses_above_critical(executor, index):
    """A model ``(x, dead)``: loss ``CHANCE x^2`` while alive, ``0.99 CHANCE`` dead (no gradient: it never learns
    again). Each step moves ``x <- x (1 - lr / 30)``, so a higher LR learns faster, until from step ``COLLAPSE_AT`` on
    an LR above ``CRITICAL`` kills the model before its step: issue 59's CNN with SGD above 2-3x its good LR, whose
    collapsed validation loss sat at 1.773-1.80 against an untrained 1.79. A merge of dead and alive models is dead
    from half on."""
    lr = float(executor.current_lrs()[executor.group_index, 0])
    if index >= COLLAPSE_AT and lr > CRITICAL:
        executor.params[1] = 1.0
    if executor.params[1] >= 0.5:
        return CHANCE_SHORT * CHANCE
    x = float(executor.params[0])
    executor.params[0] = x * (1 - lr / 30)
    return CHANCE * x**2


def test_an_ensemble_that_relapses_to_just_below_its_untrained_loss_rolls_back_and_learns_again():
    """PBT from 0.10-0.17 moves every group above the critical LR by step 30 (the loss falls from 1.79 to 1.0-1.4);
    at step 30 all collapse to 1 % below the untrained loss. No group doubled its loss (no ``rose``), none is at or
    above its untrained level (no ``stalled``, and the relapse rule before this fix asked for that): the ensemble would
    sit dead to the end. The vote at 40 finds every group within 2 % of its untrained loss after the ensemble was
    clearly below it: all ``relapsed``, one roll-back to the merge kept at 30 with every LR halved (below 0.16), and
    the ensemble learns on (its best group at 0.56 by step 120)."""
    world = FakeWorld(params=[1.0, 0.0], lr_multipliers=[1.0, 1.2, 1.44, 1.728], schedule_lrs=[0.1])
    ((cb, _), *_) = world.fit(_callback(every_n_steps=10), _collapses_above_critical, max_steps=120)
    history = cb.history
    steps = sorted({h["step"] for h in history})
    roll_backs = [s for s in steps if all(h["rescued"] for h in history if h["step"] == s)]
    assert roll_backs == [40] and {h["reason"] for h in history if h["step"] == 40} == {"relapsed"}
    relapsed_at = [h["lr"] for h in history if h["step"] == 30]  # the LRs of steps 30-39
    before = [h["loss"] for h in history if h["step"] == 30]
    assert min(relapsed_at) > CRITICAL and min(before) > CHANCE_SHORT * CHANCE / 2  # (no doubling: no `rose`)
    after = [h["lr"] for h in history if h["step"] == 40]
    assert after == pytest.approx([lr / 2 for lr in relapsed_at]) and max(after) < CRITICAL
    assert min(h["loss"] for h in history if h["step"] == 120) < 0.35 * CHANCE


@pytest.mark.parametrize(("vote", "search"), [(PBT(), False), ("pbt", Search(steps=6))], ids=["pbt", "search ends at 6"])
def test_resume_continues_the_votes_exactly(vote, search):
    """Resumed at step 8 from every group's checkpoint: ``PBT`` makes the same random moves from its restored
    generator and edge streaks, and after a search that ended at 6 the resumed run averages gradients over all groups from its first step (or
    it would not match the straight run)."""

    def run(**kw):
        world = FakeWorld(params=torch.zeros(9), lr_multipliers=[0.5, 0.8, 1.25, 2.0], schedule_lrs=[0.01])
        step = _least_squares(global_gradients=True)
        sync_aware = lambda executor, index: _least_squares(executor.gradient_sync == "global")(executor, index)  # noqa: E731
        runs = world.fit(_callback(every_n_steps=3, vote=vote, search=search), sync_aware if search else step,
                         max_steps=kw.pop("max_steps"), **kw)
        return world, runs

    straight, straight_runs = run(max_steps=16)
    half, _ = run(max_steps=16, save_at=8)
    resumed, resumed_runs = run(max_steps=16, resume=half.checkpoints)
    torch.testing.assert_close(resumed.params, straight.params, rtol=0, atol=1e-12)
    assert resumed.gradient_sync == straight.gradient_sync
    assert resumed_runs[0][0].initial_lrs == straight_runs[0][0].initial_lrs == [0.005, 0.008, 0.0125, 0.02]
    for h, k in zip(resumed_runs[0][0].history, straight_runs[0][0].history, strict=True):
        assert (h["step"], h["group"], h["winner"]) == (k["step"], k["group"], k["winner"])
        assert h["lr"] == pytest.approx(k["lr"], rel=1e-12) and h["loss"] == pytest.approx(k["loss"], rel=1e-9)


def test_the_fake_validates_the_mean_of_the_finite_groups_and_restores_to_the_initial_model() -> None:
    """The fake's validation swap and the plateau rule's restore, by hand: groups at (1, 2), (3, 4), (NaN, NaN)."""
    world = FakeWorld([[1.0, 2.0], [3.0, 4.0], [float("nan"), float("nan")]], [1.0, 1.0, 1.0])

    def body(executor: Any) -> tuple[list[float], list[float]]:
        executor.hdet.merger.validate_merged(True)
        executor.hdet.merger.validate_merged(True)  # idempotent: no second swap
        merged = executor.params.tolist()
        executor.hdet.merger.validate_merged(False)
        return merged, executor.params.tolist()

    results = world.run(body)
    assert all(merged == [2.0, 3.0] for merged, _ in results)  # mean of the two finite groups
    assert results[0][1] == [1.0, 2.0] and results[1][1] == [3.0, 4.0]  # each group's own state back
    world = FakeWorld([[1.0, 2.0], [3.0, 4.0]], [1.0, 1.0])
    world.run(lambda executor: executor.hdet.merger.ensure_restore_point(keep_initial=True))
    world.params.add_(10.0)
    for merger in world.mergers:  # as a checkpoint's `last_good` is loaded
        merger.load_restore_point(torch.tensor([5.0, 5.0], dtype=torch.float64))
    world.run(lambda executor: executor.hdet.merger.restore(initial=[False, True]))
    assert world.params.tolist() == [[5.0, 5.0], [3.0, 4.0]]  # group 1 back to its own initial model
    assert world.restarts == [1, 1]


def test_the_strategies_merger_keeps_only_a_finite_target_and_zero_coefficients_hide_a_diverged_group() -> None:
    """The strategies' own Merger over the in-memory communicator, by hand: groups at (1, 2), (3, 4), (NaN, 6)."""
    world = FakeWorld([[1.0, 2.0], [3.0, 4.0], [float("nan"), 6.0]], [1.0, 1.0, 1.0])
    world.run(lambda executor: executor.hdet.merger.ensure_restore_point())
    assert [m.restore_point.tolist() for m in world.mergers[:2]] == [[1.0, 2.0], [3.0, 4.0]]  # each rank its own
    # coefficient 0: group 2 contributes exact zeros, its NaN never reaches the target; strength 0 leaves group 0
    world.run(lambda executor: executor.hdet.merger.merge([0.25, 0.75, 0.0], [0.0, 1.0, 1.0], [False, False, True]))
    assert world.params.tolist() == [[1.0, 2.0], [2.5, 3.5], [2.5, 3.5]] and world.restarts == [0, 0, 1]
    assert all(m.restore_point.tolist() == [2.5, 3.5] for m in world.mergers)  # a finite target: the new one
    world.params[1, 0] = math.inf
    world.run(lambda executor: executor.hdet.merger.merge([0.5, 0.5, 0.0], [1.0, 1.0, 1.0], [False] * 3))
    assert all(m.restore_point.tolist() == [2.5, 3.5] for m in world.mergers)  # a non-finite target is not kept
    world.run(lambda executor: executor.hdet.merger.restore())
    assert world.params.tolist() == [[2.5, 3.5]] * 3 and world.restarts == [1, 1, 2]
