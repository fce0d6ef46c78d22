"""Benchmark 2's good LRs: the untuned arm (plain DDP at one LR, as one process on the whole job's batch) over a
log grid of LRs, per workload, optimizer and schedule; the LR whose handed-back model has the lowest median held-out
loss over the seeds is the workload's "good LR" (``GOOD_LR`` in ``search_baselines.py``, whose starts are multiples
of it). Results: ``benchmarks/results/search_calibrate_<workloads>_<schedule>_<optimizers>.json``.

Run: ``python benchmarks/search_calibrate.py --workloads tabular_small shapes_small --optimizers adamw sgd``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ALL_WORKLOADS, RESULTS_DIR, RunSpec, begin, fit_run, markdown_table, stamp, write_json
from lightning_hdet.demos.optim import SCHEDULES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["tabular_small", "shapes_small"], choices=ALL_WORKLOADS)
    p.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=("adamw", "sgd"))
    p.add_argument("--schedule", default="constant", choices=SCHEDULES)
    p.add_argument("--lrs", nargs="+", type=float, default=[10 ** (k / 3) for k in range(-12, 1)],
                   help="LRs to try (default 1e-4 .. 1, three per decade)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--val-batches", type=int, default=8, help="per-process batches (a multiple of --world-size)")
    p.add_argument("--width", type=int, default=16, help="shapes: channels of the first conv")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(f"search_calibrate_{'_'.join(args.workloads)}_{args.schedule}_{'_'.join(args.optimizers)}", False)
    rows, best = [], {}
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for workload in args.workloads:
            for optimizer in args.optimizers:
                model = {"optimizer": optimizer, "scheduler": args.schedule}
                if workload.startswith("shapes"):
                    model["width"] = args.width
                losses = {}
                for lr in args.lrs:
                    runs = [fit_run(RunSpec(lr=lr, steps=args.steps, seed=seed, batch_size=args.batch_size * args.world_size,
                                            val_every=args.steps, val_batches=args.val_batches // args.world_size,
                                            workload=workload, model=model), Path(tmp) / "run")
                            for seed in range(args.seeds)]
                    losses[lr] = [r.final_model_val_loss for r in runs]
                    rows.append([workload, optimizer, f"{lr:.3g}", f"{statistics.median(losses[lr]):.3f}",
                                 " / ".join(f"{v:.3f}" for v in losses[lr])])
                    print(" | ".join(rows[-1]), flush=True)
                best[f"{workload}/{optimizer}"] = min(losses, key=lambda lr: statistics.median(losses[lr]))
    table = markdown_table(["workload", "optimizer", "LR", "held-out loss (median)", "per seed"], rows)
    write_json(name, {"config": {k: str(v) for k, v in vars(args).items()}, "best_lr": best, "rows": rows,
                      "total_wall_s": time.perf_counter() - t0}, args.results_dir)
    print(table + "\n\nbest: " + str(best) + "\n\n" + stamp(range(args.seeds)))
    return best


if __name__ == "__main__":
    main()
