"""One Lightning job of one process in a DiLoCo run on torchft (tests/test_torchft_jobs.py,
examples/torchft_diloco.py's shape): each job reads its own stream of batches (its ``--job`` index), and writes
its final parameters and read-outs to ``--out``.

Faults: ``--kill-in-round R`` SIGKILLs this job in the middle of the run's round ``R`` (``--freeze-in-round R``:
SIGSTOPs it there, its heartbeats too; ``--freeze-in-allreduce R``: as round ``R``'s allreduce starts, after its
quorum); ``--late-in-round R --late-s S``: sleeps ``S`` seconds before round ``R``'s last step, once (a
slow node, a checkpoint save); ``--nan-from-step S`` makes
its loss NaN from step ``S`` on (its rounds are rejected until it leaves the run). ``--sync DIR``: once started,
the job writes ``DIR/ready<job>`` and waits for ``DIR/go<job>`` before ``fit`` (so that the test starts the jobs
together, or one later; the file holds how many jobs start together, and those meet again once connected to the
Lighthouse), and keeps its committed rounds in ``DIR/rounds<job>``. ``--checkpoint`` saves at every
round's end, ``--resume`` fits from a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.torchft import TorchFT, TorchFTStrategy

FEATURES, CLASSES, BATCH, LR = 6, 3, 16, 0.05


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def job_batches(job: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Job ``job``'s batches in order (the same in the test's reference)."""
    batches = []
    for step in range(steps):  # seeded per step: a longer stream starts with the same batches
        g = torch.Generator().manual_seed(10_000 * job + step)
        batches.append((torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return batches


def inner_optimizer(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=LR)


class Stream(IterableDataset):
    """Job ``job``'s batches from ``start`` on (a resumed job goes on where its checkpoint was taken)."""

    def __init__(self, job: int, steps: int, start: int) -> None:
        self.job, self.steps, self.start = job, steps, start

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(job_batches(self.job, self.steps)[self.start:])


class Job(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.net, self.args = make_model(), args

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        step = self.trainer.global_step
        time.sleep(self.args.step_s)  # emulated compute: rounds long enough for faults to land inside one
        for fault, sig in ((self.args.kill_in_round, signal.SIGKILL), (self.args.freeze_in_round, signal.SIGSTOP)):
            if self.trainer.strategy.round == fault and step % self.args.local_steps == 5:
                os.kill(os.getpid(), sig)
        if self.trainer.strategy.round == self.args.late_in_round and step % self.args.local_steps == \
                self.args.local_steps - 1:
            time.sleep(self.args.late_s)
            self.args.late_in_round = -1
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss * float("nan") if 0 <= self.args.nan_from_step <= step else loss

    def on_train_start(self) -> None:
        # the jobs given "go" together meet here, each heartbeating to the Lighthouse by now (the strategy connects
        # in its setup), so their first quorum holds them all: without it one slow to start could miss it and heal
        # into a later round (a job given "go" alone, one joining late, meets no one)
        if self.args.freeze_in_allreduce >= 0:
            self._freeze_at_allreduce(self.trainer.strategy._manager, self.args.freeze_in_allreduce)
        sync = self.args.sync
        if sync is None:
            return
        (sync / f"connected{self.args.job}").touch()
        together, deadline = int((sync / f"go{self.args.job}").read_text() or 1), time.monotonic() + 120
        while len(list(sync.glob("connected*"))) < together and time.monotonic() < deadline:
            time.sleep(0.05)

    @staticmethod
    def _freeze_at_allreduce(manager, round_: int) -> None:  # type: ignore[no-untyped-def]
        """SIGSTOP this job as round ``round_``'s allreduce starts: after the round's quorum, in its process group."""
        allreduce = manager.allreduce

        def frozen(*args, **kwargs):  # type: ignore[no-untyped-def]
            if manager.current_step() == round_:
                os.kill(os.getpid(), signal.SIGSTOP)
            return allreduce(*args, **kwargs)

        manager.allreduce = frozen

    def on_train_batch_end(self, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.ddp = isinstance(self.trainer.strategy.model, DistributedDataParallel)
        if self.args.sync is not None:
            (self.args.sync / f"rounds{self.args.job}").write_text(str(self.trainer.strategy.rounds_committed))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return inner_optimizer(self.parameters())

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        stream = Stream(self.args.job, 4 * self.args.steps, self.trainer.global_step)  # room for retrained rounds
        return DataLoader(stream, batch_size=None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--job", type=int, required=True)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--kill-in-round", type=int, default=-1)
    parser.add_argument("--freeze-in-round", type=int, default=-1)
    parser.add_argument("--freeze-in-allreduce", type=int, default=-1)
    parser.add_argument("--late-in-round", type=int, default=-1)
    parser.add_argument("--late-s", type=float, default=0.0)
    parser.add_argument("--max-rejections", type=int, default=3)
    parser.add_argument("--nan-from-step", type=int, default=-1)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--devices", type=int, default=1, help="ranks of the job (DDP inside)")
    parser.add_argument("--compression", default="none", help="TorchFTStrategy(compression=...)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="saved at every round's end")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--sync", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_hdet.torchft").setLevel(logging.DEBUG)  # each round's quorum and outcome, in the log
    if args.sync is not None:
        (args.sync / f"ready{args.job}").touch()
        deadline = time.monotonic() + 120
        while not (args.sync / f"go{args.job}").exists():
            if time.monotonic() > deadline:
                sys.exit("no go within 120 s")
            time.sleep(0.05)
    ft = TorchFT(lighthouse=args.lighthouse, min_replicas=args.min_replicas, replica_id=f"job{args.job}",
                 timeout=args.timeout, quorum_timeout=3 * args.timeout, connect_timeout=args.timeout,
                 hostname="localhost")
    strategy = TorchFTStrategy(ft, local_steps=args.local_steps, outer="published",
                               check_pushes=PushCheck(max_rejections=args.max_rejections),
                               compression=args.compression, process_group_backend="gloo")
    module = Job(args)
    callbacks = [] if args.checkpoint is None else [ModelCheckpoint(
        dirpath=args.checkpoint.parent, filename=args.checkpoint.stem, every_n_train_steps=args.local_steps,
        save_top_k=-1, enable_version_counter=False)]
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.out.parent)
    trainer.fit(module, ckpt_path=args.resume)
    if not trainer.is_global_zero:
        return
    torch.save({k: v.detach().clone() for k, v in module.net.state_dict().items()}, args.out.with_suffix(".pt"))
    args.out.write_text(json.dumps({"committed": strategy.rounds_committed, "discarded": strategy.rounds_discarded,
                                    "rejected": strategy.rounds_rejected, "healed": strategy.healed,
                                    "round": strategy.round, "global_step": trainer.global_step,
                                    "ended_behind": strategy.ended_behind, "ddp": module.ddp}))


if __name__ == "__main__":
    main()
