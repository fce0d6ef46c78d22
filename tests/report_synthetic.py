"""A small recorded run for the report tests and the docs figures.

A 1-process BoringModel run whose LightningModule logs the documented ``hdet/...`` and ``async/...``
keys with plausible values for 4 groups and 4 workers, through real Lightning loggers.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import Logger

GROUPS = 4
WORKERS = 4
STEPS = 40
VOTE_EVERY = 5
ROUND_EVERY = 3
#: Per-step seconds of the four workers (the async paper's toy example, scaled down).
STEP_TIME = (0.058, 0.075, 0.151, 0.333)
DIVERGING_GROUP = 3
DIVERGES_AT_VOTE = 2


def offline_wandb_env(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B offline and quiet, with its config/cache/data dirs under ``root`` (nothing in $HOME)."""
    for var, sub in (("WANDB_CONFIG_DIR", "cfg"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        mp.setenv(var, str(root / sub))
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")


def synthetic_metrics(steps: int = STEPS, seed: int = 0) -> dict[int, dict[str, float]]:
    """What an HDET + async run would log at each step (deterministic)."""
    rng = random.Random(seed)
    multipliers = [1.0, 0.5, 0.1, 5.0]
    base_lr, rescues, outer_updates = 1e-3, 0, 0
    losses: list[list[float]] = [[] for _ in range(GROUPS)]
    rounds: dict[int, dict[str, float]] = {}
    table: dict[int, dict[str, float]] = {}
    vote = 0
    for step in range(steps):
        row: dict[str, float] = {"hdet/mean_lr": base_lr, "hdet/rescues": float(rescues)}
        for g in range(GROUPS):
            lr = base_lr * multipliers[g]
            row[f"hdet/group{g}/lr"] = lr
            speed = min(lr / 1e-3, 3.0)
            loss = 0.3 + 2.0 * math.exp(-speed * step / 25.0) + rng.gauss(0.0, 0.02)
            if g == DIVERGING_GROUP and vote == DIVERGES_AT_VOTE:
                loss *= 4.0
            losses[g].append(loss)
        if step % VOTE_EVERY == VOTE_EVERY - 1:
            means = [sum(ls) / len(ls) for ls in losses]
            rescued = vote == DIVERGES_AT_VOTE
            avg = sum(means) / GROUPS
            raw = [0.0 if (rescued and g == DIVERGING_GROUP) else math.exp((avg - m) / 0.1)
                   for g, m in enumerate(means)]
            weights = [r / sum(raw) for r in raw]
            winner = min(range(GROUPS), key=lambda g: means[g])
            for g in range(GROUPS):
                row[f"hdet/group{g}/loss"] = means[g]
                row[f"hdet/vote/weight{g}"] = weights[g]
            row["hdet/vote/winner"] = float(winner)
            base_lr = sum(w * base_lr * m for w, m in zip(weights, multipliers))
            if rescued:
                rescues += 1
                multipliers[DIVERGING_GROUP] = 2.0
            row["hdet/rescues"] = float(rescues)
            losses = [[] for _ in range(GROUPS)]
            vote += 1
        if step % ROUND_EVERY == 0:
            local = [max(1, int(10 * min(STEP_TIME) / t)) for t in STEP_TIME]
            compute = [n * t * rng.uniform(0.9, 1.1) for n, t in zip(local, STEP_TIME)]
            for w in range(WORKERS):
                outer_updates += 1
                rounds[w] = {
                    "compute_s": compute[w],
                    "wait_s": 0.02 + 0.5 * (max(compute) - compute[w]) * rng.random(),
                    "staleness": float(rng.randint(0, WORKERS - 1)),
                    "local_steps": float(local[w]),
                    "steps_per_s": 1.0 / STEP_TIME[w],
                }
        for w, values in rounds.items():
            for name, value in values.items():
                row[f"async/worker{w}/{name}"] = value
        row["async/outer_updates"] = float(outer_updates)
        table[step] = row
    return table


def is_vote_key(key: str) -> bool:
    """Keys logged only when a vote happens."""
    return key.startswith("hdet/vote/") or (key.startswith("hdet/group") and key.endswith("/loss"))


class SyntheticHDETModule(BoringModel):
    """Logs :func:`synthetic_metrics` at its global step, as the HDET callback / async strategy would:
    per-step keys through ``self.log``, the sparse vote keys straight to the loggers (``self.log``
    would re-emit them at every later step)."""

    def __init__(self, steps: int = STEPS) -> None:
        super().__init__()
        self.table = synthetic_metrics(steps)

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        row = self.table[self.global_step]
        self.log_dict({k: v for k, v in row.items() if not is_vote_key(k)}, on_step=True, on_epoch=False)
        vote = {k: v for k, v in row.items() if is_vote_key(k)}
        if vote:
            for logger in self.loggers:
                logger.log_metrics(vote, step=self.global_step)
        return out


def record_run(loggers: list[Logger], steps: int = STEPS) -> None:
    """Run the synthetic module for ``steps`` steps on one CPU process into ``loggers``."""
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=loggers, log_every_n_steps=1,
        limit_val_batches=0, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(SyntheticHDETModule(steps))


if __name__ == "__main__":  # regenerate the docs figures: python tests/report_synthetic.py docs/img
    from lightning.pytorch.loggers import CSVLogger

    from lightning_hdet.records import write_report

    with tempfile.TemporaryDirectory() as run_dir:
        logger = CSVLogger(run_dir, name="", version="")
        record_run([logger])
        for path in write_report(logger.log_dir, Path(sys.argv[1])):
            print(path)
