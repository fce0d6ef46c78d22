"""Benchmark 1, the published HDET table reproduced on the char LM (docs/algorithms.md §1.1).

Arms, all on ``W`` processes with the same seed and data, ``S`` steps:

- **DDP, low LR** and **DDP, high LR**: Lightning's DDP; the high LR is chosen so that plain DDP
  crashes (SGD with momentum 0.9 at LR 1.0 diverges on this model; 0.1 trains well);
- **HDET** at the high LR as its *average*: one member per rank with the published fan-out
  (``spread`` 1/9), gradients averaged over all ranks (``gradient_sync="global"``), the softmax vote
  every ``T`` steps, with the published controller settings:
  - **full**: auto-LR on, mean blend, warm start ``init_noise`` 0.01;
  - **without auto-LR**: ``meta_lr=0`` (votes and merges happen, LRs never move);
  - **without warm init**: ``init_noise=0``;
  - **without blending**: ``blend_strength=1e-6`` (the smallest allowed is any positive number): votes,
    LR moves and the safety net's rescues still happen, but a merge moves parameters by a millionth;
    the final merge at the end of ``fit`` is always at full strength.

Reported: the final (merged) model's validation loss, the best validation loss rank 0 saw, whether the run
crashed (final loss not finite or no better than uniform guessing), non-finite training steps on rank 0,
safety-net rescues and the final average LR, next to the published numbers.

Run: ``python benchmarks/hdet_published.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch import Callback

from benchmarks.common import (
    hdet_callbacks,
    add_output_args,
    add_run_args,
    add_start_method_arg,
    begin,
    fill_run_defaults,
    fit_run,
    fmt,
    markdown_table,
    not_finite_or_worse_than_uniform,
    plot_panels,
    publish,
    run_spec,
)

NAME = "hdet_published"
# Published (production feed model, 8×H100, training loss): configuration -> (avg LR, loss).
PUBLISHED = {
    "DDP, low LR": ("0.0001", "3.294"),
    "DDP, high LR": ("0.0009", "4.169 (crashed ~18k steps)"),
    "HDET without auto-LR": ("0.0009", "3.280"),
    "HDET without warm init": ("0.0009", "3.281"),
    "HDET without blending": ("—", "not in the paper"),
    "HDET full": ("0.0009", "3.277"),
}


@dataclass(frozen=True)
class ArmSpec:
    """One configuration: plain DDP (``hdet=None``) or HDET with these ``HDETCallback`` arguments."""

    key: str
    name: str
    high_lr: bool
    hdet: dict | None = None


ARMS = (
    ArmSpec("ddp_low", "DDP, low LR", high_lr=False),
    ArmSpec("ddp_high", "DDP, high LR", high_lr=True),
    ArmSpec("hdet_no_autolr", "HDET without auto-LR", high_lr=True, hdet={"meta_lr": 0.0, "init_noise": 0.01}),
    ArmSpec("hdet_no_warm_init", "HDET without warm init", high_lr=True, hdet={"init_noise": 0.0}),
    ArmSpec("hdet_no_blend", "HDET without blending", high_lr=True, hdet={"blend_strength": 1e-6, "init_noise": 0.01}),
    ArmSpec("hdet_full", "HDET full", high_lr=True, hdet={"init_noise": 0.01}),
)


def run_arm(arm: ArmSpec, args: argparse.Namespace, work: Path) -> dict:
    lr = args.high_lr if arm.high_lr else args.low_lr
    return {"key": arm.key, "name": arm.name, **run_config(args, lr, args.optimizer, arm.hdet, work)}


def run_config(args: argparse.Namespace, lr: float, optimizer: str, hdet: dict | None, work: Path,
               strategy: object = None, callbacks: Sequence[Callback] = ()) -> dict:
    """One run on ``args.world_size`` processes at ``lr``: plain DDP (``hdet=None``) or HDET with one member per
    rank (fan-out ``args.spread``, gradients averaged over all ranks) and these ``HDETCallback`` arguments
    (``vote`` defaults to the published ``"softmax"``); what the tables report about it. A ``strategy`` given (with
    its ``callbacks``) is run instead, ``hdet`` then only describes it in the row."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import HDETStrategy

    spec = run_spec(args, lr, optimizer=optimizer)
    callbacks = list(callbacks)
    if strategy is None and hdet is None:
        strategy = DDPStrategy(start_method=args.start_method, process_group_backend="gloo")
    elif strategy is None:
        strategy = HDETStrategy(spread=args.spread, gradient_sync="global", start_method=args.start_method,
                                process_group_backend="gloo")
        callbacks = hdet_callbacks(args.every, seed=args.seed, **{"vote": "softmax", **hdet})
    run = fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    extra = run.rank_extra[0]
    final_lrs = extra.get("group_lrs", run.rank_lrs)
    return {
        "lr": lr,
        "hdet": hdet,
        "final_val_loss": run.final_model_val_loss,
        "best_val_loss": run.best_val_loss,
        "crashed": not_finite_or_worse_than_uniform(run.final_model_val_loss, spec.workload),
        "nonfinite_steps": sum(not math.isfinite(x) for x in run.train_loss),
        "rescues": extra.get("rescues", 0),
        "final_avg_lr": sum(final_lrs) / len(final_lrs),
        "val_curve": run.val_curve,
        "history": extra.get("history", []),
        "wall_s": run.wall_s,
    }


def table(rows: list[dict]) -> str:
    headers = [
        "configuration", "avg LR", "final val loss", "best val loss (rank 0)", "crashed", "non-finite steps",
        "rescues", "final avg LR", "published avg LR", "published loss",
    ]
    body = [
        [r["name"], fmt(r["lr"], ".3g"), fmt(r["final_val_loss"]), fmt(r["best_val_loss"]),
         "yes" if r["crashed"] else "no", str(r["nonfinite_steps"]), str(r["rescues"]),
         fmt(r["final_avg_lr"], ".3g"), *PUBLISHED[r["name"]]]
        for r in rows
    ]
    return markdown_table(headers, body)


def add_published_args(p: argparse.ArgumentParser, quick_steps: int) -> None:
    """The options of the published HDET set-up (shared with the crash benchmark): output, model and data,
    start method, W, S, T and the fan-out spread."""
    add_output_args(p)
    add_run_args(p)
    add_start_method_arg(p)
    p.add_argument("--world-size", type=int, default=None, help="W: processes, one HDET member each (default 4, quick 2)")
    p.add_argument("--steps", type=int, default=None, help=f"S (default 300, quick {quick_steps})")
    p.add_argument("--every", type=int, default=None, help="T: steps between HDET votes (default S/10, quick 4)")
    p.add_argument("--spread", type=float, default=1 / 9, help="HDET fan-out half-width (published 1/9)")


def fill_published_defaults(p: argparse.ArgumentParser, args: argparse.Namespace, quick_steps: int) -> None:
    """Quick or full defaults of :func:`add_published_args`'s options."""
    q = args.quick
    args.world_size = args.world_size or (2 if q else 4)
    args.steps = args.steps or (quick_steps if q else 300)
    args.every = args.every or (4 if q else max(args.steps // 10, 1))
    fill_run_defaults(args)
    if args.world_size < 2:
        p.error(f"--world-size={args.world_size} must be at least 2 (HDET needs several members)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_published_args(p, quick_steps=12)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--low-lr", type=float, default=0.1)
    p.add_argument("--high-lr", type=float, default=1.0, help="chosen so that plain DDP crashes")
    p.add_argument("--arms", nargs="+", default=[a.key for a in ARMS], choices=[a.key for a in ARMS],
                   metavar="ARM", help=f"configurations to run, of {[a.key for a in ARMS]} (default all)")
    args = p.parse_args(argv)
    fill_published_defaults(p, args, quick_steps=12)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(NAME, args.quick)
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        rows = [run_arm(arm, args, Path(tmp) / arm.key) for arm in ARMS if arm.key in args.arms]
    total_s = time.perf_counter() - t0
    plot = plot_panels(
        args.docs_dir / "img" / f"{name}.png",
        {"validation loss, rank 0": {r["name"]: ([s for s, _, _ in r["val_curve"]], [v for _, v, _ in r["val_curve"]])
                                     for r in rows}},
        "step", "validation loss",
    )
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes (HDET: one member each, "
        f"spread {args.spread:.3g}, gradients averaged over all ranks, softmax vote every {args.every} steps), "
        f"{args.optimizer} (momentum 0.9 for SGD), S = {args.steps} steps, seed {args.seed}. Final val loss: "
        f"the final (merged) model on the first {args.val_batches} validation batches. Total wall-clock "
        f"{total_s:.0f} s.\n\n" + table(rows) + f"\n\n![{name}](img/{plot.name})\n"
    )
    payload = {"total_wall_s": total_s, "rows": rows}
    publish(name, args, payload, md, args.max_chars)
    return payload


if __name__ == "__main__":
    main()
