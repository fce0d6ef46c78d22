"""Benchmark 3, the published asynchronous Local-SGD table reproduced on the char LM (ALGORITHMS.md §2).

Methods, on ``W`` processes (workers) with the same seed, data and inner optimizer (AdamW), and the same
sample budget ``Trainer(max_steps=S)`` (inner steps summed over workers = ``W × S``):

- **DDP** (reference): every step waits for the slowest rank;
- **DiLoCo** (``mode="sync"``): ``H`` inner steps per round, everyone waits for the slowest, outer Nesterov
  (lr 0.7, momentum 0.9);
- **async, plain Nesterov**: pushes applied on arrival with plain Nesterov SGD, fixed ``H``;
- **async DN**: Delayed Nesterov (N = W, c = 0), fixed ``H``;
- **async DN + DyLU**: Delayed Nesterov with dynamic local steps;
- **DiLoCo / async DN + DyLU with outer momentum 0.5** (``_m0.5``): the published outer momentum 0.9 oscillates
  under stale pushes when one round moves the model far, as in this short run (see docs/async.md);
- **async default**: DN + DyLU with the package's default ``outer="stable"`` (momentum warm-up and restarts, the
  outer lr of ``stable_outer_lr``);
- **DiLoCo / async DN + DyLU with workers of two ranks** (``_2ranks``, by name, ``--world-size 4``: issue 42's
  2 workers × 2 ranks, DDP inside each worker, against 4 one-rank workers and DDP over the same 4 processes; the
  same samples, since every rank takes ``S`` steps; a worker is as fast as its slowest rank).

The inner AdamW warms up linearly for S/10 steps, then decays with a cosine, as in the papers.

Worker speeds are emulated with :class:`lightning_hdet.testing.SlowRanks`, which pads every step of rank
``r`` to ``factor_r × base`` seconds: *none* (all 1), *slight* (1, 1.1, 1.2, 1.3), *moderate* (1, 1.5,
2, 2.5) and *very*, the published 0.58 / 0.75 / 1.51 / 3.33 s step times (scaled so the fastest takes
``base``; the default base exceeds the real compute time of a step here, so the padding sets the
speeds). Reported: the final global model's validation loss, and the wall-clock (rank 0's seconds in
``fit``) until rank 0's validation of the global model first reaches synchronous DiLoCo's final
validation loss under the same speeds.

``--long-horizon`` tests the paper's claim where it was made (issue 15): many rounds per worker (small H,
a small model, short padded steps) under the *very* speeds, at the published outer momentum 0.9, three seeds;
it publishes as ``async_long_horizon`` with the rounds per worker, the seed spread and each method's final
loss ÷ DiLoCo's at the same budget of inner steps ("per update").

Run: ``python benchmarks/async_published.py [--quick] [--long-horizon]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback

from benchmarks.common import (
    add_output_args,
    add_run_args,
    add_start_method_arg,
    begin,
    fill_run_defaults,
    fit_run,
    fmt,
    markdown_table,
    median,
    plot_panels,
    publish,
    run_spec,
)
from lightning_hdet.testing import PUBLISHED_STEP_SECONDS

NAME = "async_published"
LONG_HORIZON_NAME = "async_long_horizon"
#: Step-time factor of each rank relative to the fastest; ranks beyond the list repeat its last value.
LEVELS: dict[str, tuple[float, ...]] = {
    "none": (1.0,),
    "slight": (1.0, 1.1, 1.2, 1.3),
    "moderate": (1.0, 1.5, 2.0, 2.5),
    "very": tuple(s / PUBLISHED_STEP_SECONDS[0] for s in PUBLISHED_STEP_SECONDS),
}
#: method -> AsyncLocalSGDStrategy arguments (None: Lightning's DDP).
METHODS: dict[str, dict | None] = {
    "ddp": None,
    "diloco": {"mode": "sync"},
    "async_nesterov": {"mode": "async", "outer": "nesterov", "fixed": True},
    "async_dn": {"mode": "async", "fixed": True},
    "async_dn_dylu": {"mode": "async"},
    # The same two outer optimizers with momentum 0.5: in a short run one round moves the model a large part
    # of the way, and stale pushes under momentum 0.9 oscillate (docs/async.md, "Choosing the outer settings").
    "diloco_m0.5": {"mode": "sync", "momentum": 0.5},
    "async_dn_dylu_m0.5": {"mode": "async", "momentum": 0.5},
    # The package's async default: DN + DyLU with outer="stable" (the momentum warm-up and restarts, the outer lr
    # derived from the momentum, not --outer-lr); before issue 42, "robust".
    "async_default": {"mode": "async", "outer": "stable"},
    "async_robust": {"mode": "async", "outer": "robust"},
    # Workers of two ranks (DDP inside each, one push per worker; asked for by name, with --world-size 4: issue 42's
    # 2 workers x 2 ranks against 4 one-rank workers and DDP over the same 4 processes, at equal samples)
    "diloco_2ranks": {"mode": "sync", "ranks_per_worker": 2},
    "async_dn_dylu_2ranks": {"mode": "async", "ranks_per_worker": 2},
    "async_default_2ranks": {"mode": "async", "outer": "stable", "ranks_per_worker": 2},
    # The registered names as typed, Trainer(strategy="diloco") and Trainer(strategy="async_local_sgd"): every
    # option at the package's default (H = 50 included; issue 60), asked for by name
    "diloco_typed": {"mode": "sync", "typed": True},
    "async_typed": {"mode": "async", "typed": True},
    # The same with the default outer step's lr picked by a lookahead on the first validation batches
    # (DelayedNesterov(lookahead=LookaheadLR()); asked for by name, scored with --held-out)
    "diloco_lookahead": {"mode": "sync", "typed": True, "lookahead": True},
    "async_lookahead": {"mode": "async", "typed": True, "lookahead": True},
    # DiLoCo with compressed exchanges (asked for by name: the loss change against "diloco", same seed and data)
    "diloco_bf16": {"mode": "sync", "compression": "bf16"},
    "diloco_bf16_pull": {"mode": "sync", "compression": "bf16", "pull_compression": "bf16"},
}
#: Methods run unless ``--methods`` names others.
DEFAULT_METHODS = [m for m in METHODS if not m.startswith("diloco_bf16") and m != "async_robust"
                   and not m.endswith(("_2ranks", "_typed", "_lookahead"))]
# Published final perplexity on C4 (20M model, k = 4) per heterogeneity level; async DN alone is not tabulated.
PUBLISHED = {
    "diloco": {"none": 41.35, "slight": 41.35, "moderate": 41.35, "very": 41.35},
    "async_nesterov": {"none": 44.27, "slight": 44.38, "moderate": 44.29, "very": 44.27},
    "async_dn_dylu": {"none": 41.27, "slight": 41.27, "moderate": 41.09, "very": 41.13},
}


#: What ``--held-out`` scores on, for the table's header.
HELD_OUT_NOTE = " after the first ones (which validation and a lookahead read)"
#: option -> (full, quick) default; LONG_HORIZON replaces some under ``--long-horizon``.
DEFAULTS: dict[str, tuple] = {
    "world_size": (4, 2), "steps": (200, 8), "local_steps": (20, 2), "block_size": (64, 64),
    "levels": (list(LEVELS), ["none", "very"]), "methods": (DEFAULT_METHODS, DEFAULT_METHODS),
    "base_seconds": (0.1, 0.01), "seeds": (1, 1),
}
#: Many short rounds: every worker, the slowest under *very* too (one step per round under DyLU), does >= 100.
LONG_HORIZON: dict[str, tuple] = {
    "steps": (500, 16), "local_steps": (4, 2), "levels": (["very"], ["very"]), "base_seconds": (0.05, 0.01),
    "methods": (["ddp", "diloco", "async_dn_dylu", "async_default"], ["diloco", "async_dn_dylu"]),
    "seeds": (3, 1), "block_size": (32, 16), "d_model": (32, 32), "batch_size": (8, 8),
}


def factors(level: str, world: int) -> dict[int, float]:
    table = LEVELS[level]
    return {r: table[min(r, len(table) - 1)] for r in range(world)}


def run_method(method: str, level: str, seed: int, args: argparse.Namespace, work: Path,
               callbacks: Sequence[Callback] = ()) -> dict:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import (AdaptiveSteps, AsyncLocalSGDStrategy, DelayedNesterov, LookaheadLR, Nesterov,
                                SlowRanks, WorkerShape)
    from lightning_hdet.asynchronous.outer.momentum import outer_from

    spec = replace(run_spec(args, args.lr, weight_decay=0.1, scheduler="cosine", warmup_steps=args.steps // 10),
                   seed=seed, block_size=args.block_size, held_out=args.held_out)
    common = {"start_method": args.start_method, "process_group_backend": "gloo"}
    options = METHODS[method]
    if options is None:
        strategy = DDPStrategy(**common)
    elif options.get("typed"):  # the registry's arguments only (the start method changes no number)
        # the lookahead scores the batches validation reads, which --held-out leaves out of the final score
        look = LookaheadLR(batches=args.val_batches)
        outer = replace(outer_from(None), lookahead=look) if options.get("lookahead") else None
        strategy = AsyncLocalSGDStrategy(mode=options["mode"], outer=outer, **common)
    else:
        # the papers' outer optimizer (Delayed Nesterov, DiLoCo's Nesterov in sync) at --outer-lr / --outer-momentum
        # unless the method names a preset (the package's async default is "stable")
        options = dict(options)
        kind, momentum = options.pop("outer", "dn"), options.pop("momentum", args.outer_momentum)
        options["worker"] = WorkerShape(ranks_per_worker=options.pop("ranks_per_worker", 1))
        outer = kind if kind in ("stable", "robust") else (Nesterov if kind == "nesterov" else DelayedNesterov)(
            lr=args.outer_lr, momentum=momentum)
        # async: DyLU (the default), or fixed rounds; DiLoCo: every round H
        h, fixed = args.local_steps, options.pop("fixed", False) or options.get("mode") == "sync"
        strategy = AsyncLocalSGDStrategy(local_steps=h if fixed else AdaptiveSteps(h), outer=outer, **options,
                                         **common)
    slow = SlowRanks(factors(level, args.world_size), base_seconds=args.base_seconds)
    run = fit_run(spec, work, strategy=strategy, callbacks=[slow, *callbacks])
    stats = run.rank_extra[0].get("worker_stats", {})
    return {
        "method": method,
        "level": level,
        "seed": seed,
        "final_val_loss": run.final_model_val_loss,
        "val_curve": run.val_curve,
        "fit_s": run.fit_s,
        "inner_steps": {w: s["steps"] for w, s in stats.items()},
        "rounds": {w: s["rounds"] for w, s in stats.items()},
        "rejected": {w: s.get("rejected", 0) for w, s in stats.items()},
    }


def seconds_to(curve: list, target: float) -> float | None:
    """Rank 0's seconds in ``fit`` when its validation loss first reached ``target``."""
    return next((secs for _, loss, secs in curve if loss <= target), None)


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (level, method): medians over seeds of the final loss, the fit time, the seconds to
    ``target`` (DiLoCo's final rank-0 validation loss at the same level and seed) and the final loss ÷
    DiLoCo's; the seeds' range of the final loss and ratio, and of the rounds over workers; the first seed's
    curve, step counts and rounds; every seed's run under ``seeds``."""
    for run in runs:
        diloco = next((r for r in runs if r["method"] == "diloco" and (r["level"], r["seed"]) == (run["level"], run["seed"])), None)
        run["target"] = diloco["val_curve"][-1][1] if diloco and diloco["val_curve"] else None
        run["s_to_target"] = None if run["target"] is None else seconds_to(run["val_curve"], run["target"])
        run["vs_diloco"] = run["final_val_loss"] / diloco["final_val_loss"] if diloco else None
    rows = []
    for key in dict.fromkeys((r["level"], r["method"]) for r in runs):
        group = [r for r in runs if (r["level"], r["method"]) == key]
        first = group[0]
        rounds = [n for r in group for n in r["rounds"].values()]
        rows.append({
            **{k: first[k] for k in ("method", "level", "val_curve", "inner_steps", "rounds")},
            **{k: median(r[k] for r in group)
               for k in ("final_val_loss", "fit_s", "s_to_target", "target", "vs_diloco")},
            **{f"{k}_range": spread(r[k] for r in group) for k in ("final_val_loss", "vs_diloco")},
            "rounds_range": (min(rounds), max(rounds)) if rounds else None,
            "seeds": group,
        })
    return rows


def spread(values: Iterable[float | None]) -> tuple[float, float] | None:
    """(min, max) over seeds, ``None`` when a value is missing."""
    vals = list(values)
    return None if not vals or None in vals else (min(vals), max(vals))


def table(rows: list[dict], levels: list[str], methods: list[str]) -> str:
    headers = ["method"]
    for level in levels:
        headers += [f"{level}: final val loss", f"{level}: s to DiLoCo's loss (fit s)"]
    headers += [f"published ppl ({', '.join(levels)})"]
    body = []
    for method in methods:
        line = [method]
        for level in levels:
            r = next(r for r in rows if r["method"] == method and r["level"] == level)
            line += [fmt(r["final_val_loss"]), f"{fmt(r['s_to_target'], '.1f')} ({r['fit_s']:.1f})"]
        published = PUBLISHED.get(method)
        line.append(" / ".join(fmt(published[lv], ".2f") for lv in levels) if published else "—")
        body.append(line)
    return markdown_table(headers, body)


def horizon_table(rows: list[dict]) -> str:
    """The long-horizon table: one row per (level, method) with the rounds per worker and the seed spread."""
    headers = ["level", "method", "rounds per worker (min–max)", "final val loss, median (seeds' range)",
               "÷ DiLoCo's, median (seeds' range)", "s to DiLoCo's loss (fit s)", "published ppl"]
    body = []
    for r in rows:
        rounds, loss, ratio = r["rounds_range"], r["final_val_loss_range"], r["vs_diloco_range"]
        published = PUBLISHED.get(r["method"], {}).get(r["level"])
        body.append([
            r["level"], r["method"], "—" if rounds is None else f"{rounds[0]}–{rounds[1]}",
            f"{fmt(r['final_val_loss'])} ({fmt(loss[0])}–{fmt(loss[1])})",
            "—" if ratio is None
            else f"{fmt(r['vs_diloco'], '.4f')} ({fmt(ratio[0], '.4f')}–{fmt(ratio[1], '.4f')})",
            f"{fmt(r['s_to_target'], '.1f')} ({r['fit_s']:.1f})", fmt(published, ".2f"),
        ])
    return markdown_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p)
    add_run_args(p)
    add_start_method_arg(p)
    p.add_argument("--long-horizon", action="store_true",
                   help="many short rounds (defaults: "
                   f"{', '.join(f'{k}={v[0]}' for k, v in LONG_HORIZON.items())}); "
                   f"publishes as {LONG_HORIZON_NAME}")
    p.add_argument("--name", default=None, help=f"name of the results file and of the docs block (default {NAME}; "
                   f"{LONG_HORIZON_NAME} under --long-horizon)")
    p.add_argument("--world-size", type=int, default=None, help="W workers (default 4, quick 2)")
    p.add_argument("--steps", type=int, default=None, help="S: budget is W × S inner steps (default 200, quick 8)")
    p.add_argument("--local-steps", type=int, default=None, help="H (default 20, quick 2)")
    p.add_argument("--block-size", type=int, default=None, help="sequence length (default 64)")
    p.add_argument("--levels", nargs="+", default=None, choices=list(LEVELS), metavar="LEVEL",
                   help=f"heterogeneity levels of {list(LEVELS)} (default all; quick: none very)")
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS), metavar="METHOD",
                   help=f"methods of {list(METHODS)} (default all but the compressed ones)")
    p.add_argument("--base-seconds", type=float, default=None,
                   help="step time of the fastest worker; above the real compute time of a step (default 0.1, quick 0.01)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds per method and level (medians in the table; default 1)")
    p.add_argument("--lr", type=float, default=1e-2, help="inner AdamW LR")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--held-out", action="store_true", help="score the final model on the validation batches after"
                   " the first --val-batches (which validation and a lookahead read)")
    args = p.parse_args(argv)
    for option, (full, quick) in {**DEFAULTS, **(LONG_HORIZON if args.long_horizon else {})}.items():
        if getattr(args, option) is None:
            setattr(args, option, quick if args.quick else full)
    fill_run_defaults(args)
    if args.world_size < 2:
        p.error(f"--world-size={args.world_size} must be at least 2 (the async strategy needs several workers)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(args.name or (LONG_HORIZON_NAME if args.long_horizon else NAME), args.quick)
    runs = []
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for seed in range(args.seed, args.seed + args.seeds):
            for level in args.levels:
                for method in args.methods:
                    runs.append(run_method(method, level, seed, args, Path(tmp) / f"{level}_{method}_{seed}"))
    total_s = time.perf_counter() - t0
    rows = summarise(runs)
    plot = plot_panels(
        args.docs_dir / "img" / f"{name}.png",
        {f"speeds: {level}": {r["method"]: ([s for _, _, s in r["val_curve"]], [v for _, v, _ in r["val_curve"]])
                              for r in rows if r["level"] == level}
         for level in args.levels},
        "seconds (rank 0, in fit)", "validation loss (global model)",
    )
    ratios = {lv: [round(f, 2) for f in factors(lv, args.world_size).values()] for lv in args.levels}
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} workers, budget W × S = "
        f"{args.world_size} × {args.steps} inner steps, H = {args.local_steps}, char LM d_model "
        f"{args.d_model}, {args.n_layers} layers, sequence {args.block_size}, batch {args.batch_size}; inner "
        f"AdamW lr {args.lr:g} "
        f"(weight decay 0.1; linear warm-up for S/10 steps, then cosine decay to 10 % at step S, where a fast worker "
        f"past step S stays), outer lr {args.outer_lr:g}, momentum {args.outer_momentum:g}; fastest step padded "
        f"to {args.base_seconds:g} s; step-time factors per rank: {ratios}; seeds "
        f"{args.seed}..{args.seed + args.seeds - 1} (medians). Final val loss: the "
        f"final global model on the {'next' if args.held_out else 'first'} {args.val_batches} validation batches"
        f"{HELD_OUT_NOTE if args.held_out else ''} (nats/byte; the paper reports "
        f"perplexity on C4). Total wall-clock {total_s:.0f} s.\n\n"
        + (horizon_table(rows) if args.long_horizon else table(rows, args.levels, args.methods))
        + f"\n\n![{name}](img/{plot.name})\n"
    )
    payload = {"total_wall_s": total_s, "rows": rows}
    publish(name, args, payload, md, args.max_chars)
    return payload


if __name__ == "__main__":
    main()
