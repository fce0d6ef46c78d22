"""Vote signals from the interval's loss curve: the accumulator and the pure fits, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.hdet.rules.signals import (
    LossCurve, bin_centers, curve_points, fit_exponential, forecast, mean_loss, score, scores, slope,
)


def test_bin_centers_are_the_mean_step_of_each_bin():
    assert bin_centers(8, 4) == [0.5, 2.5, 4.5, 6.5]
    # positions 0..9 into 4 bins: p * 4 // 10 -> [0,0,0,1,1,2,2,2,3,3]
    assert bin_centers(10, 4) == [1.0, 3.5, 6.0, 8.5]


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


def test_curve_points_slope_and_mean():
    row = [7.0, 3.0, 2.0, 2.0]  # bins at steps 0.5 and 2.5 with means 3.5 and 1.5
    assert curve_points(row, 4) == [(0.5, 3.5), (2.5, 1.5)]
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)]) == pytest.approx(0.5)  # sxy = 1, sxx = 2
    assert math.isnan(slope([(0.0, 1.0)])) and math.isnan(slope([(0.0, 1.0), (1.0, math.nan)]))
    assert mean_loss(row) == 2.5
    assert score(row, "mean", 4) == 2.5
    assert score(row, "improvement", 4) == pytest.approx(-1.0)
    assert curve_points([0.0, 5.0, 0.0, 1.0], 4) == [(2.5, 5.0)]  # empty bins are skipped
    assert math.isnan(mean_loss([0.0, 0.0, 0.0, 0.0]))


def test_exponential_fit_recovers_an_exact_curve_and_forecasts_it():
    interval = 10
    c = 0.5 * 1.25**4 / interval  # a rate on the fit's grid
    points = [(float(x), 2.0 + 3.0 * math.exp(-c * x)) for x in range(interval)]
    a, b, fitted_c = fit_exponential(points, interval)
    assert (a, b, fitted_c) == pytest.approx((2.0, 3.0, c), rel=1e-9)
    assert forecast(points, interval, 40.0) == pytest.approx(2.0 + 3.0 * math.exp(-40 * c), rel=1e-9)
    assert fit_exponential(points[:2], interval) is None
    assert forecast(points[:2], interval, 40.0) == points[1][1]  # too few points: the last one's loss
    assert math.isnan(forecast([], interval, 40.0))


def test_forecast_credits_a_steeper_curve_the_mean_ranks_behind():
    """The short-horizon bias in one picture: the curve that is higher on average but still falls fast wins."""
    interval, bins = 16, 8
    rows = []
    for a, b, c in ((1.00, 1.0, 0.4), (0.60, 1.5, 0.1)):  # settled early / still falling steeply
        curve = LossCurve(interval, bins)
        for t in range(interval):
            curve.add(t, torch.tensor(a + b * math.exp(-c * t)))
        rows.append(curve.row())
    table = torch.stack(rows)
    means = scores(table, "mean", interval)
    assert means[0] < means[1]
    assert scores(table, "improvement", interval)[1] < scores(table, "improvement", interval)[0]
    forecasts = scores(table, "forecast", interval, horizon=64)
    assert forecasts[1] < forecasts[0]
    with pytest.raises(ValueError, match="`signal` must be one of"):
        score([1.0, 1.0], "level", interval)


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
