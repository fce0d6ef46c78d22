"""Blend rules as pure functions."""

import pytest

from lightning_hdet.hdet.rules.blends import blend_coefficients, blend_strengths


def test_mean_weighted_best():
    healthy = [True, True, False, True]
    assert blend_coefficients("mean", [0.1, 0.2, 0.3, 0.4], 1, healthy) == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    assert blend_coefficients("weighted", [0.1, 0.2, 0.0, 0.2], 1, healthy) == pytest.approx([0.2, 0.4, 0, 0.4])
    assert blend_coefficients("best", [0, 1, 0, 0], 1, healthy) == [0.0, 1.0, 0.0, 0.0]


def test_strengths_and_errors():
    assert blend_strengths(0.3, [False, True]) == [0.3, 1.0]
    with pytest.raises(ValueError, match="`blend` must be one of"):
        blend_coefficients("median", [1.0], 0, [True])
    with pytest.raises(ValueError, match="healthy winner"):
        blend_coefficients("best", [1.0, 0.0], 1, [True, False])
