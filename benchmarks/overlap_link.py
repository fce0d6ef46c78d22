"""Overlap on a slow link: training wall-clock, each worker's waits and the final loss, blocking exchange against
``overlap_steps=τ`` (issue 43, item 1), in DiLoCo and async mode.

A controlled shape, so that compute and link are known: Lightning's BoringModel with SGD (lr 0.05), 2 workers,
every step padded to ``--step-seconds`` (``SlowRanks``), rank 1 behind a ``SlowLink`` of 1 Mbit/s and
``--latency`` seconds each way. Wall-clock is rank 0's ``on_train_start`` to ``on_train_end`` (no process start-up).
On a loaded machine the steps take longer than their padding at times: compare within one run, seed by seed.

Run: ``python benchmarks/overlap_link.py [--seeds 3] [--overlap-steps 4]``; prints a markdown table and its stamp.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from benchmarks.common import adaptive_rounds, add_start_method_arg, begin, markdown_table, stamp


class SGDBoring(BoringModel):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def held_out_loss(model: torch.nn.Module) -> float:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), torch.ones(len(x), 2)))


class Record(Callback):
    """Rank 0 writes the training wall-clock, the global model's loss and each worker's summed waits."""

    def __init__(self, out: Path) -> None:
        self.out, self.start, self.end = out, 0.0, 0.0

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.end = time.perf_counter()

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            result = trainer.strategy.result
            self.out.write_text(json.dumps({"train_s": self.end - self.start, "loss": held_out_loss(pl_module),
                                            "wait": {w: r.total_wait_s for w, r in result.workers.items()},
                                            "steps_done": result.steps_done}))


def fit(mode: str, overlap: int, seed: int, args: argparse.Namespace, work: Path) -> dict:
    from lightning_hdet import AsyncLocalSGDStrategy, SlowLink, SlowRanks, WorkerShape

    seed_everything(seed)
    out = work / f"{mode}_{overlap}_{seed}.json"
    Trainer(strategy=AsyncLocalSGDStrategy(local_steps=adaptive_rounds(args.local_steps, mode), mode=mode, start_method=args.start_method,
                                           worker=WorkerShape(overlap_steps=overlap)),
            accelerator="cpu", devices=2, max_steps=args.steps, limit_val_batches=0, num_sanity_val_steps=0,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=work, callbacks=[SlowRanks({}, base_seconds=args.step_seconds),
                                              SlowLink(bits_per_s=1e6, latency_s=args.latency), Record(out)]
            ).fit(SGDBoring())
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds, from 0")
    parser.add_argument("--steps", type=int, default=120, help="max_steps (per rank, as in DDP)")
    parser.add_argument("--local-steps", type=int, default=8)
    parser.add_argument("--overlap-steps", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--latency", type=float, default=0.03)
    add_start_method_arg(parser)
    args = parser.parse_args()
    begin("overlap_link", False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            runs = {tau: [fit(mode, tau, seed, args, Path(tmp)) for seed in range(args.seeds)]
                    for tau in (0, args.overlap_steps)}
            for tau, seeds in runs.items():
                rows.append([{"sync": "DiLoCo", "async": "async"}[mode], tau,
                             " / ".join(f"{r['train_s']:.2f}" for r in seeds),
                             " / ".join(f"{r['train_s'] / b['train_s']:.2f}" for r, b in zip(seeds, runs[0])),
                             " / ".join(f"{sum(r['wait'].values()):.2f}" for r in seeds),
                             " / ".join(f"{r['loss']:.4f}" for r in seeds),
                             " / ".join(str(r["steps_done"]) for r in seeds)])
                print(rows[-1], flush=True)
    header = ["mode", "τ", "training s", "÷ blocking", "waits s (both workers)", "final loss", "steps done"]
    print(markdown_table(header, rows) + f"\n\n2 workers, H = {args.local_steps}, {args.steps} steps per rank, "
          f"steps padded to {args.step_seconds} s, rank 1 behind 1 Mbit/s + {args.latency} s each way; seeds "
          f"0–{args.seeds - 1}\n\n{stamp(range(args.seeds))}")


if __name__ == "__main__":
    main()
