"""DiLoCo across three Lightning jobs on torchft, on one machine (CPU, about a minute).

This script starts torchft's Lighthouse and three one-process Lightning jobs on loopback, each its own torchft
replica group reading its own shard of the data; every 10 steps the live jobs average their pseudo-gradients and
each runs the same outer step. With ``--kill-one`` job 2 dies (SIGKILL) in the middle of the run: the two left
reduce that round without it (its heartbeats stopped) and finish the run (the same rounds).

    pip install lightning-hdet[torchft]
    python examples/torchft_diloco.py [--kill-one]

On several machines, run ``torchft_lighthouse`` once and one job per node instead (docs/elastic.md, "DiLoCo on
torchft").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet.torchft import TorchFT, TorchFTStrategy

JOBS = 3


def data(shard: int) -> TensorDataset:
    """Shard ``shard`` of a regression task (``-1``: the held-out rows)."""
    g = torch.Generator().manual_seed(1 + shard)
    x = torch.randn(1024, 16, generator=g)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] * x[:, 2:3]
    return TensorDataset(x, y)


class Regression(LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.args = args

    def training_step(self, batch, batch_idx):
        strategy = self.trainer.strategy
        if self.args.kill and strategy.round == self.args.steps // 20 and batch_idx % 10 == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-round, halfway through the run
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self):
        # the example's jobs start training together: each is heartbeating to the Lighthouse by now (the strategy
        # connects in its setup), so the first quorum waits for all three. Without this a job slow to start on a busy
        # machine could miss the first rounds and heal into a later one (a real job may join at any time)
        (self.args.barrier / f"ready{self.args.job}").touch()
        deadline = time.monotonic() + 300
        while len(list(self.args.barrier.glob("ready*"))) < JOBS and time.monotonic() < deadline:
            time.sleep(0.1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return DataLoader(data(self.args.job), batch_size=32, shuffle=True)


def job(args: argparse.Namespace) -> None:
    """One Lightning job: one torchft replica group (here one process; ``devices=N`` trains DDP inside it)."""
    seed_everything(0)  # the same start everywhere (torchft also sends the first job's model to the others)
    ft = TorchFT(lighthouse=args.lighthouse, min_replicas=2, replica_id=f"job{args.job}", timeout=30,
                 quorum_timeout=120)
    strategy = TorchFTStrategy(ft, local_steps=10, outer="published")
    model = Regression(args)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    x, y = data(-1).tensors
    with torch.no_grad():
        loss = nn.functional.mse_loss(model.net(x), y).item()
    print(json.dumps({"job": args.job, "round": strategy.round, "committed": strategy.rounds_committed,
                      "discarded": strategy.rounds_discarded, "healed": strategy.healed,
                      "ended_behind": strategy.ended_behind, "held_out_loss": loss}))  # True: take another job's model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="inner steps per job (a multiple of 10)")
    parser.add_argument("--kill-one", dest="kill_one", action="store_true", help="job 2 dies halfway")
    parser.add_argument("--job", type=int, default=None, help=argparse.SUPPRESS)  # set for the jobs
    parser.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job is not None:
        return job(args)
    from torchft.coordination import LighthouseServer

    # min_replicas=2: a round needs two live jobs; a dead one leaves the quorum after 2 s without heartbeats, a
    # live one late at a round's start is waited for up to 10 s
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=2000, join_timeout_ms=10_000)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    barrier = Path(tempfile.mkdtemp())
    jobs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--job", str(i), "--lighthouse",
                              lighthouse.address(), "--steps", str(args.steps), "--barrier", str(barrier),
                              *(["--kill"] if args.kill_one and i == JOBS - 1 else [])],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(JOBS)]
    try:
        for i, p in enumerate(jobs):
            out, err = p.communicate(timeout=600)
            last = (err.strip().splitlines() or [""])[-1]  # a job that failed says why (its last line)
            print(out.strip().splitlines()[-1] if p.returncode == 0 else f"job {i}: ended with {p.returncode}"
                  + (f" ({last})" if p.returncode > 0 else ""))
    finally:
        for p in jobs:
            p.kill()
        lighthouse.shutdown()
        shutil.rmtree(barrier)


if __name__ == "__main__":
    main()
