"""Every public HDET object crosses torch.multiprocessing's spawn under torch's default sharing strategy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch import Trainer, seed_everything

from lightning_hdet import PBT, Best, HDETCallback, HDETStrategy, Softmax
from lightning_hdet.hdet.rules.defaults import DEFAULT_LR_SPAN, span_grid
from tests.helpers import Recorder, SGDBoring, load_ranks, trainer_kwargs


def _receive(index: int, objects: list) -> None:
    assert [type(o).__name__ for o in objects] == ["HDETCallback", "HDETStrategy", "Softmax", "Best", "PBT"]


def test_public_objects_cross_a_spawn():
    assert mp.get_sharing_strategy() == "file_descriptor"  # torch's default on Linux: no global switch hides bugs
    callback = HDETCallback(seed=3)
    callback.controller.generator  # a generator that has been used must cross too (PyTorch #146828)
    mp.start_processes(_receive, args=([callback, HDETStrategy(), Softmax(), Best(), PBT()],), nprocs=1,
                       start_method="spawn")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["hdet_spawn", "instance"])
def test_hdet_spawn_with_an_explicit_callback(tmp_path, strategy):
    """Votes move the LRs (best vote: the winner keeps its multiplier, the other is re-centred on it) and every
    rank ends with the merged model."""
    seed_everything(0)
    initial = span_grid(2, DEFAULT_LR_SPAN)  # the default multipliers
    if strategy == "instance":
        initial = [0.5, 2.0]
        strategy = HDETStrategy(lr_multipliers=initial, start_method="spawn")
    callback = HDETCallback(every_n_steps=2, vote=Best(shrink=0.5, min_spread=0.05), search=False, seed=1)
    trainer = Trainer(strategy=strategy, callbacks=[callback, Recorder(tmp_path)],
                      **trainer_kwargs(devices=2, max_steps=4))
    trainer.fit(SGDBoring())
    ranks = load_ranks(tmp_path, 2)
    history = ranks[0]["history"]
    votes = sorted({h["step"] for h in history})
    assert votes == [2, 4]
    first = [h for h in history if h["step"] == 2]
    winner = first[0]["winner"]
    assert winner == min(range(2), key=lambda g: first[g]["loss"])
    # best vote, 2 groups: the winner keeps its multiplier m; the other gets m * exp(2 * spread), spread = half the
    # log-range of the initial multipliers, shrunk by 0.5 (schedule LR 0.1 throughout)
    m = initial[winner]
    spread = max(0.5 * (math.log(max(initial)) - math.log(min(initial))) / 2, 0.05)
    assert first[winner]["lr"] == pytest.approx(0.1 * m, rel=1e-12)
    assert first[1 - winner]["lr"] == pytest.approx(0.1 * m * math.exp(2 * spread), rel=1e-12)
    assert all(torch.equal(r["final_params"], ranks[0]["final_params"]) for r in ranks)
    assert all(torch.equal(r["lr_multipliers"], ranks[0]["lr_multipliers"]) for r in ranks)
