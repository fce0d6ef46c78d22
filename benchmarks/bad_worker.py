"""Benchmark 3's runs with one bad worker (issue 29): one of the workers' device goes bad halfway through its
share of the budget, against the same run without a fault.

From its ``S/2``-th step on, rank ``--bad-rank``'s parameters are NaN before every training step (a faulty device:
every loss, gradient and step it computes is non-finite, whatever global model it pulled). With the default
``check_pushes=True`` the worker discards its rounds, is told, and stops after ``max_rejections`` rejections in a
row; the others spend the budget. Reported per method and speed level: the final global model's validation loss
and the wall-clock of ``fit``, with and without the fault, and the pushes rejected.

Run: ``python benchmarks/bad_worker.py [--quick]`` (benchmark 3's options: ``--steps``, ``--local-steps``, ...).
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.async_published import factors, parse_args, run_method
from benchmarks.common import begin, fmt, markdown_table, publish

NAME = "bad_worker"
METHODS = ("diloco", "async_default")


class BadDevice(Callback):
    """Rank ``rank``'s parameters are NaN before each of its training steps from its ``step``-th on."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.fill_(math.nan)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    bad_rank = 1
    if "--bad-rank" in argv:
        i = argv.index("--bad-rank")
        bad_rank = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    methods = [m for m in args.methods if m in METHODS] or list(METHODS)
    name, t0 = begin(NAME, args.quick)
    runs = []
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for level in args.levels:
            for method in methods:
                for fault in (False, True):
                    callbacks = [BadDevice(bad_rank, args.steps // 2)] if fault else []
                    work = Path(tmp) / f"{level}_{method}_{fault}"
                    run = run_method(method, level, args.seed, args, work, callbacks)
                    runs.append({**run, "fault": fault, "val_curve": None})
    rows = []
    for level in args.levels:
        for method in methods:
            clean, bad = (next(r for r in runs if (r["level"], r["method"], r["fault"]) == (level, method, f))
                          for f in (False, True))
            rows.append([level, method, fmt(clean["final_val_loss"]), fmt(bad["final_val_loss"]),
                         fmt(bad["final_val_loss"] / clean["final_val_loss"], ".3f"), f"{clean['fit_s']:.1f}",
                         f"{bad['fit_s']:.1f}", str(sum(bad["rejected"].values())),
                         str(bad["inner_steps"].get(str(bad_rank), 0))])
    total_s = time.perf_counter() - t0
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; benchmark 3's runs (W = {args.world_size}, budget W × "
        f"{args.steps}, H = {args.local_steps}, char LM d_model {args.d_model}, inner AdamW lr {args.lr:g}, the "
        f"package's defaults for the checks), seed {args.seed}; fault: rank {bad_rank}'s parameters NaN before "
        f"every step from its step {args.steps // 2} on; step-time factors "
        f"{ {lv: [round(f, 2) for f in factors(lv, args.world_size).values()] for lv in args.levels} }. "
        f"Total wall-clock {total_s:.0f} s.\n\n"
        + markdown_table(["speeds", "method", "final val loss, no fault", "with the bad worker", "÷ no fault",
                          "fit s, no fault", "fit s, bad worker", "pushes rejected", "bad worker's applied steps"],
                         rows) + "\n"
    )
    payload = {"total_wall_s": total_s, "runs": runs}
    publish(name, args, payload, md)
    return payload


if __name__ == "__main__":
    main()
