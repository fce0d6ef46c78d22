"""Insurance in a real run (issue 28): the default HDET travels toward a known better learning rate from 10x too low
and 10x too high, and stays put from the right one; three processes, three groups, the defaults but the interval.
The research rules (issue 41) on the same fit: which of them travel, and that every one stays put."""

from __future__ import annotations

import pytest
import torch

# Adam on the helpers' least squares (8 features, batch 16): the loss after 32 steps, one process, by LR (measured
# once, a sweep of 0.003..5): 0.003 9.2, 0.01 6.8, 0.02 4.2, 0.05 0.65, 0.1 0.25, 0.2 0.25, 0.3 0.33, 0.5 0.94,
# 1 1.06, 2 1.7; after 64 steps 0.02 1.2, 0.05 0.011, 0.1 0.009, 0.3 0.017, 1 0.86. The known better LRs are
# 0.05..0.3 early and reach down to 0.02 later (a converging run gains from a lower LR); 0.1 is the right start.
UP, DOWN, RIGHT = (0.03, 0.35), (0.01, 0.35), (0.05, 0.2)


def _last_winner(history: list[dict]) -> dict:
    last = [h for h in history if h["step"] == max(h["step"] for h in history)]
    return last[last[0]["winner"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("start", "band"), [(0.01, UP), (1.0, DOWN), (0.1, RIGHT), (0.0025, UP), (4.0, DOWN)],
                         ids=["10x-too-low-travels-up", "10x-too-high-travels-down", "right-stays-put",
                              "40x-too-low-travels-up", "40x-too-high-travels-down"])
def test_the_default_hdet_travels_toward_a_better_lr_and_stays_put_from_the_right_one(tmp_path, start, band):
    """``HDETStrategy()`` on three processes: three groups at 0.19, 1 and 5.2 x the start (the default 27x span),
    PBT, the search ending at step 16 around its winner (ratio 1.5), a vote every 8 steps. From 10x too low the
    top group wins and the run ends in the better band (plain Adam at 0.01 is still at 4.0 after 64 steps); from
    10x too high the bottom one; from the right LR the centre keeps winning and the last winner's LR stays within
    2x of it. From 40x off the grid travels past its edge (a probe one step of its spacing beyond an edge that led
    two votes in a row) and ends in the band too. Every rank agrees on the history, and the last winner's interval
    loss is that of a good LR. Only from too high does the search end at or below a third of the start LR, and every
    group restarts from the initial model there (``Search.restart_below``): the model after the restart is the one
    the fit started from."""
    from lightning.pytorch import Trainer, seed_everything

    from lightning_hdet import HDETCallback, HDETStrategy
    from tests.helpers import START, LinearModel, Recorder, flat_params, load_ranks, trainer_kwargs

    seed_everything(0)
    trainer = Trainer(strategy=HDETStrategy(start_method=START), callbacks=[HDETCallback(every_n_steps=8),
                      Recorder(tmp_path)], **trainer_kwargs(devices=3, max_steps=64))
    model = LinearModel(lr=start, optimizer="adam")
    initial = flat_params(model)
    trainer.fit(model)
    ranks = load_ranks(tmp_path, 3)
    history = ranks[0]["history"]
    assert all(r["history"] == history for r in ranks)
    winner = _last_winner(history)
    assert band[0] <= winner["lr"] <= band[1], (start, winner)
    assert winner["loss"] < 0.5
    restarted = ranks[0]["restarted_at"]
    # No roll-back of the whole ensemble, but after a restart the plateau rule's: it keeps the search's best and its
    # clock, and 16 steps (two votes, its shortest patience) are too few for the restarted run to get below it.
    allowed = {"", "stalled", "x best"} | ({"plateau"} if restarted is not None else set())
    assert {h["reason"] for h in history} <= allowed
    assert all(r["restarted_at"] == restarted for r in ranks) and (restarted is not None) == (start >= 1.0)
    if restarted is not None:
        assert all(torch.equal(r["params_by_step"][restarted], initial) for r in ranks)


def _rule(name: str):
    """The strategy, the callback and the processes of one research rule (lightning_hdet.experimental and the
    options off by default): each is what a user writes to try it."""
    from lightning_hdet import HDETCallback, HDETStrategy, Search
    from lightning_hdet.experimental import Halving
    from tests.helpers import START

    if name == "evidence":
        return HDETStrategy(start_method=START), HDETCallback(every_n_steps=8, search=Search(evidence=2.5)), 3
    # Four processes: the incumbent grid (0.19, 1, 1, 5.2) needs four groups to hold a cluster beside a probe each way.
    vote = Halving() if name == "cluster+halving" else "pbt"
    return HDETStrategy(start_method=START, gradient_sync="cluster"), HDETCallback(every_n_steps=8, vote=vote), 4


# The incumbent's cluster (and halving over it) travels neither way in 64 steps here: its only probes, 0.19x and 5.2x,
# lose the first vote (a 5x higher Adam LR is still the worst at step 8), and PBT's x1.2 steps are too slow from then
# on (10x too low ends at 0.018-0.032, loss ~1; 10x too high at 0.0094-0.0096 after the plateau ladder). The
# benchmarks measured the same loss from 10x too low (research log, "Clusters", 2026-12-03): why it is experimental.
CASES = [(0.01, UP), (1.0, DOWN), (0.1, RIGHT)]
RULE_CASES = [pytest.param(rule, *case, id=f"{rule}-{name}") for rule in ("evidence",)
              for case, name in zip(CASES, ("10x-too-low-travels-up", "10x-too-high-travels-down", "right-stays-put"))]
RULE_CASES += [pytest.param(rule, *CASES[2], id=f"{rule}-right-stays-put") for rule in ("cluster", "cluster+halving")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("rule", "start", "band"), RULE_CASES)
def test_each_research_rule_travels_toward_a_better_lr_and_stays_put_from_the_right_one(tmp_path, rule, start, band):
    """The rules kept in ``experimental`` or off by default (issue 41: the sequential test that ends the search
    early, the incumbent's cluster, successive halving over clusters), each as a user sets it and the
    rest at the defaults, on the fit above: every rank agrees on the history, and the last winner's LR is in the
    band a good LR lies in, with the interval loss of a good LR (the clusters: from the right LR only, above)."""
    from lightning.pytorch import Trainer, seed_everything

    from tests.helpers import LinearModel, Recorder, load_ranks, trainer_kwargs

    seed_everything(0)
    strategy, callback, devices = _rule(rule)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)],
                      **trainer_kwargs(devices=devices, max_steps=64))
    trainer.fit(LinearModel(lr=start, optimizer="adam"))
    ranks = load_ranks(tmp_path, devices)
    history = ranks[0]["history"]
    assert all(r["history"] == history for r in ranks)
    winner = _last_winner(history)
    assert band[0] <= winner["lr"] <= band[1], (rule, start, winner)
    assert winner["loss"] < 0.5
