"""The interval's loss curve: the accumulator and what the vote reads from it, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.rules.signals import LossCurve, mean_loss


def test_loss_curve_bins_sums_and_counts():
    curve = LossCurve(interval=4, bins=2)
    for position, loss in enumerate([4.0, 3.0, 2.0, 1.0]):
        curve.add(position, torch.tensor(loss))
    curve.add(5, torch.tensor([0.5, 0.5]))  # past the interval: the last bin; a vector counts as its sum
    assert curve.row().tolist() == [7.0, 4.0, 2.0, 3.0]
    copy = LossCurve(interval=4, bins=2)
    copy.load_row(curve.row())
    assert copy.row().tolist() == curve.row().tolist()
    curve.reset()
    assert curve.row().tolist() == [0.0, 0.0, 0.0, 0.0]
    short = LossCurve(interval=3, bins=8)  # never more bins than steps
    short.add(2, torch.tensor(1.0))
    assert short.bins == 3 and short.row().tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="`bins` must be an integer >= 2"):
        LossCurve(interval=4, bins=1)


def test_mean_loss_is_the_interval_mean_per_step():
    assert mean_loss([7.0, 3.0, 2.0, 2.0]) == 2.5  # 10 over 4 steps
    assert math.isnan(mean_loss([0.0, 0.0, 0.0, 0.0]))


def test_curve_error_is_the_spread_of_the_bin_means_over_root_n():
    from lightning_hdet.hdet.rules.signals import curve_error

    # Bin means 1, 2, 3 (sums 2, 4, 6 over 2 steps each): sample std 1, standard error 1 / sqrt(3).
    assert curve_error([2.0, 4.0, 6.0, 2.0, 2.0, 2.0]) == pytest.approx(1 / math.sqrt(3))
    assert curve_error([2.0, 0.0, 2.0, 0.0]) == 0.0  # one bin: no spread to measure


def test_meter_pools_the_first_step_over_every_rank_with_its_standard_error():
    from lightning_hdet.hdet.execution.meter import _pooled_first

    # Group 0: ranks with first losses 1 and 3 (sum 4, squares 10); group 1: one rank at 2. Mean 2 over n = 3,
    # sample variance ((1-2)^2 + (3-2)^2 + 0) / 2 = 1, standard error sqrt(1 / 3).
    mean, error = _pooled_first([[4.0, 10.0, 2.0], [2.0, 4.0, 1.0]])
    assert mean == pytest.approx(2.0) and error == pytest.approx(math.sqrt(1 / 3))
    assert _pooled_first([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) == (None, 0.0)
