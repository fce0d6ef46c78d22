"""Run config, vote history and one-W&B-run-per-job helpers, against real offline loggers."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import wandb
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from tests.report_synthetic import offline_wandb_env

from lightning_hdet.records import load_history
from lightning_hdet.records.wandb import (
    VOTE_COLUMNS,
    finish_worker_run,
    flatten_config,
    log_vote_history,
    record_config,
    vote_rows,
    vote_table,
)

CONFIG = {"groups": 4, "vote": {"mode": "softmax", "sigma": 0.1}, "lrs": (1e-3, 5e-4, 1e-4, 5e-3),
          "device": object}
VOTES = [(4, g, 1e-3 * (g + 1), 2.0 - 0.1 * g, 0.25, 3, False) for g in range(4)]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    offline_wandb_env(monkeypatch, tmp_path)


def wandb_summary(run_dir) -> dict:
    """State, config and summary of an offline run, via W&B's own reader."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, WANDB_MODE="offline"))
    return json.loads(out.stdout)


def test_flatten_config_nests_under_prefix_and_makes_values_loggable():
    flat = flatten_config("hdet", CONFIG)
    assert flat == {"hdet/groups": 4, "hdet/vote/mode": "softmax", "hdet/vote/sigma": 0.1,
                    "hdet/lrs": [1e-3, 5e-4, 1e-4, 5e-3], "hdet/device": str(object)}
    for bad in ("", "/hdet", "async/"):
        with pytest.raises(ValueError, match=f"prefix={bad!r}"):
            flatten_config(bad, CONFIG)


def test_record_config_reaches_csv_hparams(tmp_path):
    logger = CSVLogger(tmp_path, name="", version="")
    record_config([logger], "async", {"workers": 4, "outer": {"lr": 0.7}})
    logger.save()
    hparams = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert hparams == {"async/workers": 4, "async/outer/lr": 0.7}


def test_record_config_reaches_tensorboard_hparams(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="", version="")
    record_config(logger, "hdet", {"groups": 4})
    logger.save()
    assert yaml.safe_load((tmp_path / "hparams.yaml").read_text()) == {"hdet/groups": 4}


@pytest.mark.timeout(120)
def test_record_config_and_vote_table_reach_the_wandb_run(tmp_path, offline_wandb):
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="utils")
    record_config(logger, "hdet", CONFIG)
    assert log_vote_history(logger, VOTES, step=4) == vote_rows(VOTES)
    logger.experiment.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    config = wandb_summary(run)["config"]
    assert {k: config[k] for k in flatten_config("hdet", CONFIG)} == flatten_config("hdet", CONFIG)
    history = load_history(run)
    assert history.rows[4]["hdet/vote/history.nrows"] == len(VOTES)
    assert history.rows[4]["hdet/vote/history.ncols"] == len(VOTE_COLUMNS)


def test_vote_table_and_plain_fallback(tmp_path):
    table = vote_table(VOTES)
    assert table.columns == list(VOTE_COLUMNS)
    assert table.data[3] == [4, 3, 4e-3, pytest.approx(1.7), 0.25, 3, False]
    logger = CSVLogger(tmp_path, name="", version="")
    rows = log_vote_history(logger, [dict(zip(VOTE_COLUMNS, v)) for v in VOTES])
    assert rows == vote_rows(VOTES) and all(r["winner"] == 3 for r in rows)
    with open(tmp_path / "vote_history.csv", newline="") as file:
        written = list(csv.DictReader(file))
    assert [int(r["group"]) for r in written] == [0, 1, 2, 3] and written[3]["winner"] == "3"
    with pytest.raises(ValueError, match=r"lacks \['rescued'\]"):
        vote_rows([{c: 0 for c in VOTE_COLUMNS if c != "rescued"}])
    with pytest.raises(ValueError, match="has 3 values"):
        vote_table([(1, 2, 3)])


def test_hdet_rows_add_what_each_group_trained_at_to_the_csv_and_the_wandb_table(tmp_path):
    # Vote 4 resumed from a checkpoint older than trained_lr (blank), vote 8 recorded it; weight_decay explored.
    old = [{**dict(zip(VOTE_COLUMNS, v)), "explored": {"weight_decay": 0.02}} for v in VOTES[:2]]
    new = [{**dict(zip(VOTE_COLUMNS, (8, g, 0.3, 1.0, 0.5, 1, False))), "trained_lr": 1e-3 * (g + 1),
            "explored": {"weight_decay": 0.03}, "trained_explored": {"weight_decay": 0.02}} for g in range(2)]
    columns = [*VOTE_COLUMNS, "trained_lr", "weight_decay", "trained_weight_decay"]
    table = vote_table(old + new)
    assert table.columns == columns
    assert table.data[2][7:] == [1e-3, 0.03, 0.02] and table.data[3][7:] == [2e-3, 0.03, 0.02]
    assert math.isnan(table.data[0][7]) and math.isnan(table.data[0][9]) and table.data[0][8] == 0.02
    log_vote_history(CSVLogger(tmp_path, name="", version=""), old + new)
    with open(tmp_path / "vote_history.csv", newline="") as file:
        written = list(csv.DictReader(file))
    assert list(written[0]) == columns
    assert [(r["lr"], r["trained_lr"]) for r in written] == [("0.001", "nan"), ("0.002", "nan"), ("0.3", "0.001"),
                                                              ("0.3", "0.002")]


class _WandbWiring(Callback):
    """What the HDET callback does: record its config at setup, finish a worker-owned run at teardown."""

    def setup(self, trainer, pl_module, stage):
        record_config(trainer, "hdet", {"groups": 2})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("hdet/group0/lr", 1e-3 * (1 + trainer.global_rank))

    def teardown(self, trainer, pl_module, stage):
        finish_worker_run(trainer)


@pytest.mark.timeout(180)
# ddp_fork is left out: forking a process that already runs W&B's and torch's threads hung under load here.
@pytest.mark.parametrize("strategy", ["ddp_spawn"])
def test_two_process_job_writes_exactly_one_complete_wandb_run(tmp_path, offline_wandb, strategy):
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="one-run")
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=3, logger=logger,
                      callbacks=[_WandbWiring()], log_every_n_steps=1, limit_val_batches=0,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(BoringModel())
    wandb.finish()  # spawn: the main process owns the run its rank-0 worker attached to
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    summary = wandb_summary(runs[0])
    assert summary["state"] == "finished" and summary["config"]["hdet/groups"] == 2
    assert sorted(load_history(runs[0]).series("hdet/group0/lr")[0]) == [0, 1, 2]
