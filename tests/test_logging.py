"""A real 4-process HDET run logs every documented key to one offline W&B run, CSVLogger and TensorBoard."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import pytest
import wandb
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.records import load_history
from tests.helpers import START, LinearModel, trainer_kwargs
from tests.report_synthetic import offline_wandb_env
from tests.test_wandb_utils import wandb_summary

GROUPS = 4


def tensorboard_tags(log_dir: str) -> set[str]:
    """Scalar tags in TensorBoard event files (TFRecord framing: length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in Path(log_dir).glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            offset += 12 + length + 4
    return tags


def documented_keys(groups: int) -> set[str]:
    keys = {"hdet/vote/winner", "hdet/mean_lr", "hdet/rescues"}
    for g in range(groups):
        keys |= {f"hdet/group{g}/lr", f"hdet/group{g}/loss", f"hdet/vote/weight{g}"}
    return keys


@pytest.mark.timeout(300)
def test_hdet_run_logs_every_key_to_one_wandb_run_and_csv(tmp_path, monkeypatch):
    offline_wandb_env(monkeypatch, tmp_path)
    seed_everything(0)
    wandb_logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="hdet-keys")
    csv_logger = CSVLogger(save_dir=tmp_path, name="csv", version=0)
    tb_logger = TensorBoardLogger(save_dir=tmp_path, name="tb", version=0)
    trainer = Trainer(strategy=HDETStrategy(spread=0.5, gradient_sync="global", start_method=START),
                      callbacks=[HDETCallback(every_n_steps=2, search=False)],
                      **trainer_kwargs(logger=[wandb_logger, csv_logger, tb_logger], log_every_n_steps=1, max_steps=6))
    trainer.fit(LinearModel())
    wandb.finish()

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1  # one run per job, not one per process
    history = load_history(runs[0])
    assert documented_keys(GROUPS) <= history.keys
    steps, winners = history.series("hdet/vote/winner")
    assert steps == [2, 4, 6] and all(0 <= w < GROUPS for w in winners)
    summary = wandb_summary(runs[0])
    assert summary["config"]["hdet/num_groups"] == GROUPS
    assert summary["config"]["hdet/callback/every_n_steps"] == 2

    log_dir = csv_logger.log_dir
    with open(f"{log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    present = {k for row in rows for k, v in row.items() if v not in ("", None)}
    assert documented_keys(GROUPS) <= present  # every group's value, not only group 0's
    with open(f"{log_dir}/vote_history.csv") as f:
        votes = list(csv.DictReader(f))
    assert len(votes) == 3 * GROUPS and {int(v["group"]) for v in votes} == set(range(GROUPS))
    assert documented_keys(GROUPS) <= tensorboard_tags(tb_logger.log_dir)  # the same keys in TensorBoard
