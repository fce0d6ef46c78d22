"""Issue 15's first target as a benchmark: at the package's defaults, does asynchronous Local-SGD leave the global
model better than it started, on every task and at every speed level?

Three tasks of different kinds, each on ``W`` = 4 workers with ``AsyncLocalSGDStrategy(local_steps=H)`` and
nothing else set (``outer="stable"``), against the default before it (``outer="robust"``: lr 0.7 with warm-up and
restarts) and the papers' outer setting (``outer="published"``: lr 0.7, momentum 0.9, no warm-up or restarts) on
the same seed, data and speeds:

- ``regression``: Lightning's ``BoringModel`` (a 32 -> 2 linear regression onto ones) with SGD lr 0.05, as the
  issue tried it; loss: mean squared error on 256 fixed held-out inputs;
- ``char_lm`` and ``shapes``: the byte-level Transformer and the conv net of ``benchmarks/common.py`` with AdamW
  (weight decay 0.1; the char LM with a linear warm-up for S/10 steps, then cosine decay, the conv net at a
  constant LR); loss: validation cross-entropy on the same first batches for every run.

Speeds are the four levels of benchmark 3 (``SlowRanks``). Reported: the final global model's loss ÷ the initial
model's (< 1: the run improved the model), the median and the worst over seeds.

Run: ``python benchmarks/async_defaults.py [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.async_published import LEVELS, factors
from benchmarks.common import (
    RunSpec,
    add_output_args,
    add_start_method_arg,
    begin,
    build_workload,
    evaluate,
    fit_run,
    fmt,
    markdown_table,
    median,
    publish,
)

NAME = "async_defaults"
TASKS = ("regression", "char_lm", "shapes")
#: The outer settings compared: the package's default, the default before it (issue 42), and the papers'.
OUTERS = ("stable", "robust", "published")
#: AdamW LR per task (benchmark 2's good LRs).
LR = {"char_lm": 1e-2, "shapes": 5e-3}


def regression_loss(model: torch.nn.Module) -> float:
    """Mean squared error onto ones on 256 fixed held-out inputs (the same for every run)."""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), torch.ones(len(x), 2)))


def run_regression(strategy, slow, seed: int, steps: int, work: Path) -> tuple[float, float]:
    """The issue's case: BoringModel with SGD lr 0.05; (initial, final) loss of the global model."""
    from lightning.pytorch import Trainer, seed_everything

    from tests.test_async_defaults import SGDBoring  # importable by name: spawned ranks unpickle the module

    seed_everything(seed, verbose=False)
    model = SGDBoring()
    initial = regression_loss(model)
    Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=steps, limit_val_batches=0,
            num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=work, callbacks=[slow]).fit(model)
    return initial, regression_loss(model)  # rank 0 holds the global model after fit


def run_task(task: str, outer: str, level: str, seed: int, args: argparse.Namespace, work: Path) -> dict:
    from lightning.pytorch import seed_everything

    from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy, SlowRanks

    strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(args.local_steps), outer=outer, start_method=args.start_method,
                                     process_group_backend="gloo")
    slow = SlowRanks(factors(level, 4), base_seconds=args.base_seconds[task])
    if task == "regression":
        initial, final = run_regression(strategy, slow, seed, args.steps, work)
    else:
        model: dict = {"weight_decay": 0.1}
        if task == "char_lm":
            model.update(d_model=args.d_model, n_layers=2, scheduler="cosine", warmup_steps=args.steps // 10)
        spec = RunSpec(lr=LR[task], steps=args.steps, seed=seed, devices=4, batch_size=16, val_every=args.steps,
                       val_batches=args.val_batches, model=model, workload=task)
        seed_everything(seed, verbose=False)  # as fit_run does: the same initial model
        initial = evaluate(*build_workload(spec), args.val_batches)
        final = fit_run(spec, work, strategy=strategy, callbacks=[slow]).final_model_val_loss
    return {"task": task, "outer": outer, "level": level, "seed": seed, "initial": initial, "final": final,
            "ratio": final / initial}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p)
    add_start_method_arg(p)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--levels", nargs="+", default=None, choices=list(LEVELS), help="default all; quick: very")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..n-1 (default 2, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="S: a budget of 4 × S inner steps (default 120, quick 8)")
    p.add_argument("--local-steps", type=int, default=None, help="H (default 12, quick 2)")
    p.add_argument("--d-model", type=int, default=32, help="char LM width")
    p.add_argument("--val-batches", type=int, default=None, help="default 8, quick 2")
    args = p.parse_args(argv)
    q = args.quick
    args.levels = args.levels or (["very"] if q else list(LEVELS))
    args.seeds = args.seeds or (1 if q else 2)
    args.steps = args.steps or (8 if q else 120)
    args.local_steps = args.local_steps or (2 if q else 12)
    args.val_batches = args.val_batches or (2 if q else 8)
    # the fastest worker's padded step: above a step's real compute time here, so that the padding sets the speeds
    args.base_seconds = {"regression": 0.01 if q else 0.06, "char_lm": 0.01 if q else 0.1, "shapes": 0.01 if q else 0.1}
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(NAME, args.quick)
    runs = []
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for task in args.tasks:
            for level in args.levels:
                for seed in range(args.seeds):
                    for outer in OUTERS:
                        runs.append(run_task(task, outer, level, seed, args, Path(tmp) / f"{task}_{level}_{seed}_{outer}"))
    rows = []
    for task in args.tasks:
        for outer in OUTERS:
            line = [task, outer]
            for level in args.levels:
                ratios = [r["ratio"] for r in runs if (r["task"], r["outer"], r["level"]) == (task, outer, level)]
                line.append(f"{fmt(median(ratios), '.3f')} ({fmt(max(ratios), '.3f')})")
            rows.append(line)
    total_s = time.perf_counter() - t0
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = 4 workers, budget 4 × {args.steps} inner steps, "
        f"H = {args.local_steps}; seeds 0..{args.seeds - 1}; fastest step padded to {args.base_seconds} s. Cells: "
        "final ÷ initial loss of the global model, median over seeds (worst in brackets); < 1: improved. "
        f"Total wall-clock {total_s:.0f} s.\n\n"
        + markdown_table(["task", "outer", *(f"{level}" for level in args.levels)], rows) + "\n"
    )
    payload = {"total_wall_s": total_s, "runs": runs}
    publish(name, args, payload, md, seeds=range(args.seeds))  # seeds 0..n-1 whatever --seed says
    return payload


if __name__ == "__main__":
    main()
