"""``HDETCallback(monitor="auto")``'s decision (lightning_hdet/hdet/lightning/auto_monitor.py), in one process."""

from __future__ import annotations

import pytest

from lightning_hdet.hdet.lightning.auto_monitor import AUTO_METRIC, MAX_WAIT, choose, epochs_read


def test_epochs_read_is_the_run_over_one_epoch_and_unknown_without_either() -> None:
    assert epochs_read(300, 8.0) == pytest.approx(37.5)
    assert epochs_read(None, 8.0) is None and epochs_read(300, None) is None
    assert epochs_read(300, float("inf")) is None and epochs_read(300, 0.0) is None


def test_a_run_that_reads_its_data_once_votes_on_the_training_loss_and_says_nothing() -> None:
    assert choose(1.0, 10.0, 20) == (None, "")
    assert choose(0.3, 10.0, 20) == (None, "")
    assert choose(None, 10.0, 20) == (None, "")


def test_a_repeating_run_that_validates_often_enough_votes_on_val_loss() -> None:
    name, line = choose(37.5, 19.0, 38)
    assert name == AUTO_METRIC and "reads its training data 37.5 times" in line and "monitor=None" in line
    name, _ = choose(4.0, MAX_WAIT * 38, 38)  # a validation every two intervals: still read
    assert name == AUTO_METRIC


def test_a_repeating_run_without_usable_validation_warns_with_the_fix() -> None:
    name, line = choose(4.0, None, 38)
    assert name is None and "Log `val_loss` in a `validation_step`" in line and "monitor='your_metric'" in line
    name, line = choose(4.0, MAX_WAIT * 38 + 1, 38)  # validating too rarely: the votes would wait
    assert name is None and "Validate at least every 76 steps (now every 77" in line
    assert "val_check_interval=38, check_val_every_n_epoch=None" in line
