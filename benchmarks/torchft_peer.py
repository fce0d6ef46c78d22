"""Benchmark 9, the peer: torchft 0.2.0's ``DiLoCo`` beside ours (``mode="sync"``, ``outer="published"``) on the
same workload and settings (issue 60, item 6).

Two workers, each its own stream of batches of the tabular task (:mod:`lightning_hdet.demos.tabular`, an MLP),
AdamW inside at a constant lr, ``H`` inner steps per round, outer Nesterov SGD (lr 0.7, momentum 0.9), the same seed
and start. Arms, each in its own processes:

- **ours**: ``AsyncLocalSGDStrategy(mode="sync", outer="published")`` on ``devices=2`` (Lightning's launcher);
- **torchft**: a Lighthouse (in this process) and two one-process replica groups, each a ``Manager`` (gloo,
  synchronous quorum) with ``torchft.local_sgd.DiLoCo`` around a plain PyTorch loop.

Reported: the final global model's loss on held-out rows, the wall-clock from launch to the last exit (start-up
included), the payload bytes on the wire, and the largest difference between the two final models' parameters
(the numerics agree when it is within rounding: target <= 1e-4). Run: ``python benchmarks/torchft_peer.py
[--quick]``; an arm alone: ``--arm ours|torchft`` (what the parent runs).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish
from lightning_hdet.demos.tabular import make_tabular

NAME = "torchft_peer"
REPO = Path(__file__).resolve().parents[1]
FEATURES, CLASSES, HIDDEN, BATCH, INNER_LR = 16, 8, 64, 32, 3e-3
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # outer="published"


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def worker_batches(worker: int, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``worker``'s batches, in order: its own rows of the task, the same in both arms."""
    x, y = make_tabular(steps * BATCH, FEATURES, CLASSES, seed=1000 * (seed + 1) + worker, task_seed=seed)
    return list(zip(x.split(BATCH), y.split(BATCH)))


def held_out_loss(model: nn.Module, seed: int) -> float:
    x, y = make_tabular(4096, FEATURES, CLASSES, seed=999_999, task_seed=seed)
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def run_ours(args: argparse.Namespace) -> None:
    """One Lightning job of two processes (this command is re-run for rank 1 by the launcher)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_hdet import AsyncLocalSGDStrategy

    class Batches(IterableDataset):
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(worker_batches(self.rank, args.steps, args.seed))

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.seed)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=INNER_LR)

        def train_dataloader(self):  # type: ignore[no-untyped-def]
            return DataLoader(Batches(self.global_rank), batch_size=None)

    strategy = AsyncLocalSGDStrategy(mode="sync", local_steps=args.local_steps, outer="published")
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=args.out.parent)
    trainer.fit(module)
    if trainer.is_global_zero:
        result = strategy.result
        assert result is not None
        torch.save({"state": module.net.state_dict(), "bytes": result.push_bytes + result.pull_bytes,
                    "rounds": result.outer_updates}, args.out)


def run_torchft(args: argparse.Namespace) -> None:
    """One torchft replica group of one process, with its own store, as torchft's DiLoCo examples run it."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    model = make_model(args.seed)
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    # init_sync=False: both start from the same seed (with True, its first round's quorum replaces replica 1's
    # parameters, i.e. its first round, by replica 0's)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=2, use_async_quorum=False, init_sync=False, rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=f"peer_{args.replica}", hostname="localhost", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout)
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.local_steps):
            for x, y in worker_batches(args.replica, args.steps, args.seed):
                inner.zero_grad()
                F.cross_entropy(model(x), y).backward()
                inner.step()  # its hooks run the round's allreduce and outer step every H steps
        if args.replica == 0:
            torch.save({"state": model.state_dict(), "rounds": manager.current_step()}, args.out)
    finally:
        manager.shutdown(wait=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(arm: str, args: argparse.Namespace, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--arm", arm, "--out", str(out), "--steps", str(args.steps),
           "--local-steps", str(args.local_steps), "--seed", str(args.seed), "--timeout", str(args.timeout), *extra]
    return subprocess.Popen(cmd, env=env, stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)


def wait_all(processes: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"{p.args} exited with {p.returncode}")


def compare(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    name, _ = begin(NAME, args.quick)
    rows: dict[str, dict] = {}
    models: dict[str, dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        wait_all([launch("ours", args, work / "ours.pt")], args.timeout)
        ours = torch.load(work / "ours.pt")
        rows["ours"] = {"wall_s": time.perf_counter() - start, "bytes": ours["bytes"], "rounds": ours["rounds"]}
        models["ours"] = ours["state"]

        lighthouse = LighthouseServer(bind=f"127.0.0.1:{free_port()}", min_replicas=2)
        try:
            start = time.perf_counter()
            wait_all([launch("torchft", args, work / f"ft{i}.pt", "--replica", str(i), "--lighthouse",
                             lighthouse.address()) for i in range(2)], args.timeout)
        finally:
            lighthouse.shutdown()
        ft = torch.load(work / "ft0.pt")
        n = sum(t.numel() for t in ft["state"].values())
        # gloo's ring allreduce over W replicas: each sends and receives 2 (W - 1) / W of the payload per round
        rows["torchft"] = {"wall_s": time.perf_counter() - start, "bytes": 2 * 2 * (2 - 1) / 2 * 4 * n * ft["rounds"],
                           "rounds": ft["rounds"]}
        models["torchft"] = ft["state"]
    diff = max(float((models["ours"][k] - models["torchft"][k]).abs().max()) for k in models["ours"])
    for arm, row in rows.items():
        model = make_model(args.seed)
        model.load_state_dict(models[arm])
        row["loss"] = held_out_loss(model, args.seed)
    initial = held_out_loss(make_model(args.seed), args.seed)
    payload = {"rows": rows, "max_param_diff": diff, "initial_loss": initial}
    publish(name, args, payload, table(rows, diff, initial, args), seeds=[args.seed])


def table(rows: dict[str, dict], diff: float, initial: float, args: argparse.Namespace) -> str:
    labels = {"ours": 'ours, `outer="published"`', "torchft": "torchft 0.2.0 `DiLoCo`"}
    body = [[labels[arm], str(r["rounds"]), fmt(r["loss"], ".4f"), fmt(r["wall_s"], ".1f"),
             f"{r['bytes'] / 2**20:.2f}"] for arm, r in rows.items()]
    head = (f"{'Quick' if args.quick else 'Full'}: 2 workers, H = {args.local_steps}, {args.steps} steps each, AdamW "
            f"inside, Nesterov {OUTER_LR} / {OUTER_MOMENTUM}; tabular MLP (start loss {initial:.3f}). **Largest "
            f"parameter difference {diff:.1e}** (target 1e-4). Bytes: ours as sent, torchft's computed (ring).")
    headers = ["arm", "rounds", "held-out loss", "wall s", "MiB"]
    return head + "\n\n" + markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=("ours", "torchft"), default=None, help="run one arm's process (internal)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per worker (default 600, quick 80)")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    add_output_args(parser)
    args = parser.parse_args()
    args.steps = args.steps or (80 if args.quick else 600)
    if args.arm == "ours":
        run_ours(args)
    elif args.arm == "torchft":
        run_torchft(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
