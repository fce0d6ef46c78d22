"""Benchmark 2, the claim tested: finding the learning rate at equal total compute.

A job has ``W`` processes and ``G`` groups; every method gets ``W × S`` rank-steps:

- **grid search**: the ``G`` LRs of the grid, one run each on ``W/G`` processes for ``S`` steps
  (deployed side by side, so its wall-clock is that of the slowest run);
- **Optuna TPE**: ``G`` trials one after another, each on ``W/G`` processes for ``S`` steps, searching
  log-uniformly over the grid's range; the first trial is the starting LR;
- **population-based training**: a minimal, faithful re-implementation of the synchronous exploit/explore
  loop of Jaderberg et al. (2017) as Ray Tune's ``PopulationBasedTraining`` does it — Ray itself is too
  heavy for a 2-core box. ``G`` members start at the grid's LRs; every ``T`` steps the bottom quarter
  copy a random top-quarter member's checkpoint (weights and optimizer state) and perturb its LR by
  ×1.2 or ×0.8, or resample it from the range with probability 0.25;
- **HDET**: one run on ``W`` processes in ``G`` groups (each its own DDP job on ``W/G`` processes) at
  the grid's LRs, voting and blending every ``T`` steps (the PBT interval); by default ``vote="best"``,
  ``blend="best"``, the groups-of-replicas form our users describe.

Each method starts from a good LR, 10× too high and 10× too low (the grid is centred on the start).
Reported per method: best validation loss, the LR it settled on, compute (rank-steps) and wall-clock to
reach a target loss (``1 + margin`` times the best loss any method reached), medians over seeds.
Deployed wall-clock assumes each method's natural deployment on W devices (grid and PBT members side by
side, Optuna trials in sequence) and is computed from measured per-run fit times.

Run: ``python benchmarks/search_baselines.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    DOCS_DIR,
    RESULTS_DIR,
    RunResult,
    RunSpec,
    begin,
    fit_run,
    fmt,
    markdown_table,
    median,
    plot_panels,
    update_doc_section,
    write_json,
)

NAME = "search_baselines"
STARTS = {"good": 1.0, "10x high": 10.0, "10x low": 0.1}
METHODS = ("grid", "optuna_tpe", "pbt", "hdet")
# Ray Tune's PopulationBasedTraining defaults.
PBT_QUANTILE = 0.25
PBT_FACTORS = (1.2, 0.8)
PBT_RESAMPLE_P = 0.25


@dataclass
class Arm:
    """One method from one start on one seed: ``curve`` rows are ``(rank_steps, best val loss so far,
    deployed seconds)``; ``wall_s`` is what it took on this machine."""

    method: str
    start: str
    seed: int
    settled_lr: float
    best_val_loss: float
    curve: list[tuple[int, float, float]]
    lrs_tried: list[float]
    diverged_runs: int
    wall_s: float
    extra: dict = field(default_factory=dict)


def lr_grid(center: float, groups: int, spread: float) -> list[float]:
    """``groups`` LRs spaced by a factor ``spread``, geometrically centred on ``center``."""
    return [center * spread ** (k - (groups - 1) / 2) for k in range(groups)]


def _best_so_far(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Sort ``(compute, loss, seconds)`` by compute and keep the running minimum of the loss."""
    out, best = [], math.inf
    for compute, loss, secs in sorted(points):
        best = min(best, loss) if math.isfinite(loss) else best
        out.append((compute, best, secs))
    return out


def run_grid(start: str, lrs: list[float], base: RunSpec, world: int, work: Path) -> Arm:
    runs = [fit_run(replace(base, lr=lr), work / f"grid{g}") for g, lr in enumerate(lrs)]
    points = []
    for step in sorted({s for r in runs for s, _, _ in r.val_curve}):
        rows = [next((row for row in r.val_curve if row[0] == step), None) for r in runs]
        rows = [row for row in rows if row is not None]
        points.append((world * step, min(row[1] for row in rows), max(row[2] for row in rows)))
    best = min(runs, key=lambda r: r.best_val_loss)
    return Arm(
        "grid", start, base.seed, best.spec.lr, best.best_val_loss, _best_so_far(points), lrs,
        sum(r.diverged for r in runs), sum(r.wall_s for r in runs),
    )


def run_optuna(start: str, start_lr: float, lo: float, hi: float, trials: int, base: RunSpec, work: Path) -> Arm:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=base.seed, n_startup_trials=1)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial({"lr": start_lr})
    runs: list[RunResult] = []

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", lo, hi, log=True)
        runs.append(fit_run(replace(base, lr=lr), work / f"trial{trial.number}"))
        return runs[-1].best_val_loss

    study.optimize(objective, n_trials=trials)
    points, spent_steps, spent_s = [], 0, 0.0
    for r in runs:
        points += [(base.devices * (spent_steps + s), loss, spent_s + secs) for s, loss, secs in r.val_curve]
        spent_steps += r.spec.steps
        spent_s += r.fit_s
    best = min(runs, key=lambda r: r.best_val_loss)
    return Arm(
        "optuna_tpe", start, base.seed, best.spec.lr, best.best_val_loss, _best_so_far(points),
        [r.spec.lr for r in runs], sum(r.diverged for r in runs), sum(r.wall_s for r in runs),
    )


def pbt_explore(lr: float, lo: float, hi: float, rng: random.Random) -> float:
    """Ray's explore step for a continuous hyperparameter: resample from the range with probability
    0.25, otherwise multiply by 1.2 or 0.8."""
    if rng.random() < PBT_RESAMPLE_P:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return lr * rng.choice(PBT_FACTORS)


def run_pbt(
    start: str, lrs: list[float], lo: float, hi: float, interval: int, base: RunSpec, world: int, work: Path
) -> Arm:
    rng = random.Random(base.seed)
    members = list(lrs)
    ckpts: list[Path | None] = [None] * len(members)
    n_swap = max(1, int(len(members) * PBT_QUANTILE))
    points, deployed_s, wall_s, diverged, history = [], 0.0, 0.0, 0, []
    for rnd, step in enumerate(range(interval, base.steps + 1, interval)):
        results = []
        for m, lr in enumerate(members):
            spec = replace(base, lr=lr, steps=step, val_every=interval, seed=base.seed + 1000 * rnd + m)
            out = work / f"member{m}_round{rnd}.ckpt"
            results.append(fit_run(spec, work / f"member{m}", ckpt_path=ckpts[m], save_ckpt=out))
            ckpts[m] = out
        losses = [r.final_val_loss if not r.diverged else math.inf for r in results]
        diverged += sum(r.diverged for r in results)
        wall_s += sum(r.wall_s for r in results)
        deployed_s += max(r.fit_s for r in results)
        points.append((world * step, min(losses), deployed_s))
        history.append({"step": step, "lrs": list(members), "val_losses": losses})
        if step + interval > base.steps:
            break
        order = sorted(range(len(members)), key=lambda m: losses[m])
        for loser in order[-n_swap:]:
            winner = rng.choice(order[:n_swap])
            ckpts[loser] = work / f"member{loser}_from{winner}_round{rnd}.ckpt"
            shutil.copyfile(ckpts[winner], ckpts[loser])
            members[loser] = pbt_explore(members[winner], lo, hi, rng)
    final = history[-1]
    best_m = min(range(len(members)), key=lambda m: final["val_losses"][m])
    return Arm(
        "pbt", start, base.seed, final["lrs"][best_m], min(p[1] for p in points), _best_so_far(points),
        sorted({lr for h in history for lr in h["lrs"]}), diverged, wall_s, extra={"history": history},
    )


def run_hdet_arm(
    start: str, lrs: list[float], base: RunSpec, world: int, groups: int, interval: int, vote: str, blend: str,
    work: Path,
) -> Arm:
    """HDET: one run of ``base.steps`` steps on ``world`` processes in ``groups`` groups starting at ``lrs``.

    Each group is its own DDP job on ``world / groups`` processes (``gradient_sync="group"``); with one
    process per group the data is not sharded, so a group reads the whole training stream as the matching
    grid run does (shuffled in its own order) and validates on the same first batches. Every ``interval`` steps the groups vote on
    their interval training loss and blend. The best-so-far curve takes, at each validation, the best group
    (each group's first rank), as the grid takes the best of its runs.
    """
    from lightning_hdet import HDETCallback, HDETStrategy

    center = math.exp(sum(map(math.log, lrs)) / len(lrs))
    strategy = HDETStrategy(
        num_groups=groups, lr_multipliers=[lr / center for lr in lrs], gradient_sync="group",
        start_method="spawn", process_group_backend="gloo",
    )
    callback = HDETCallback(every_n_steps=interval, vote=vote, blend=blend, seed=base.seed)
    spec = replace(base, lr=center, devices=world, shard_data=world > groups)
    run = fit_run(spec, work, strategy=strategy, callbacks=[callback])
    heads = [g * (world // groups) for g in range(groups)]
    points = []
    for step in sorted({s for s, _, _ in run.val_curve}):
        rows = [row for g in heads for row in run.rank_val_curves[g] if row[0] == step]
        points.append((world * step, min(row[1] for row in rows), max(row[2] for row in rows)))
    final = {g: run.rank_val_curves[h][-1][1] for g, h in enumerate(heads)}
    group_lrs = run.rank_extra[0]["group_lrs"]
    best_group = min(final, key=lambda g: final[g] if math.isfinite(final[g]) else math.inf)
    curve = _best_so_far(points)
    history = run.rank_extra[0]["history"]
    return Arm(
        "hdet", start, base.seed, group_lrs[best_group], curve[-1][1] if curve else math.inf, curve,
        sorted({row["lr"] for row in history} | set(lrs)), int(run.diverged), run.wall_s,
        extra={"history": history, "rescues": run.rank_extra[0]["rescues"],
               "merged_model_val_loss": run.final_model_val_loss},
    )


def run_start(start: str, args: argparse.Namespace, seed: int, work: Path) -> list[Arm]:
    center = args.good_lr * STARTS[start]
    per_member = args.world_size // args.groups
    base = RunSpec(
        lr=center, steps=args.steps, seed=seed, devices=per_member, batch_size=args.batch_size,
        max_chars=args.max_chars, val_every=args.val_every, val_batches=args.val_batches,
        model={"d_model": args.d_model, "n_layers": args.n_layers},
    )
    lrs = lr_grid(center, args.groups, args.lr_spread)
    lo, hi = lrs[0], lrs[-1]
    arms = [
        run_grid(start, lrs, base, args.world_size, work / "grid"),
        run_optuna(start, center, lo, hi, args.groups, base, work / "optuna"),
        run_pbt(start, lrs, lo, hi, args.pbt_interval, base, args.world_size, work / "pbt"),
    ]
    arms.append(run_hdet_arm(
        start, lrs, base, args.world_size, args.groups, args.pbt_interval, args.hdet_vote, args.hdet_blend,
        work / "hdet",
    ))
    return arms


def to_target(curve: list[tuple[int, float, float]], target: float) -> tuple[int | None, float | None]:
    """First ``(compute, deployed seconds)`` on a best-so-far curve at or below ``target``."""
    return next(((c, s) for c, loss, s in curve if loss <= target), (None, None))


def summarise(arms: list[Arm], margin: float) -> tuple[float, list[dict]]:
    """Target loss and one row per (start, method) with medians over seeds."""
    reached = [a.best_val_loss for a in arms if math.isfinite(a.best_val_loss)]
    target = (1 + margin) * min(reached)
    rows = []
    for start in STARTS:
        for method in METHODS:
            group = [a for a in arms if a.start == start and a.method == method]
            if not group:
                continue
            hits = [to_target(a.curve, target) for a in group]
            rows.append({
                "start": start,
                "method": method,
                "best_val_loss": median(a.best_val_loss for a in group),
                "settled_lr": median(a.settled_lr for a in group),
                "rank_steps_to_target": median(h[0] for h in hits),
                "deployed_s_to_target": median(h[1] for h in hits),
                "wall_s": median(a.wall_s for a in group),
                "diverged_runs": sum(a.diverged_runs for a in group),
                "seeds": len(group),
            })
    return target, rows


def table(rows: list[dict], start_lrs: dict[str, float]) -> str:
    headers = [
        "start (LR)", "method", "best val loss", "settled LR", "rank-steps to target",
        "deployed s to target", "wall s (this machine)", "diverged runs",
    ]
    body = []
    for r in rows:
        start = f"{r['start']} ({start_lrs[r['start']]:.2g})"
        body.append([
            start, r["method"], fmt(r["best_val_loss"]), fmt(r["settled_lr"], ".2g"),
            fmt(r["rank_steps_to_target"], "d"), fmt(r["deployed_s_to_target"], ".1f"),
            fmt(r["wall_s"], ".1f"), str(r["diverged_runs"]),
        ])
    return markdown_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budget, one seed (about a minute on 2 cores)")
    p.add_argument("--world-size", type=int, default=4, help="W: processes of the job")
    p.add_argument("--starts", nargs="+", default=list(STARTS), choices=list(STARTS), metavar="START",
                   help=f"starting LRs to run, of {list(STARTS)} (default all)")
    p.add_argument("--groups", type=int, default=4, help="G: LRs in the grid / trials / PBT members / HDET groups")
    p.add_argument("--steps", type=int, default=None, help="S: steps per run (default 320, quick 32)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3, quick 1)")
    p.add_argument("--good-lr", type=float, default=1e-2, help="the good starting LR (best AdamW LR of a coarse sweep)")
    p.add_argument("--lr-spread", type=float, default=3.0, help="factor between neighbouring grid LRs")
    p.add_argument("--pbt-interval", type=int, default=None,
                   help="PBT steps between exploits, and HDET steps between votes (default S/4)")
    p.add_argument("--hdet-vote", default="best", choices=("best", "softmax"), help="HDETCallback vote rule")
    p.add_argument("--hdet-blend", default="best", choices=("best", "mean", "weighted"), help="HDETCallback blend")
    p.add_argument("--val-every", type=int, default=None, help="steps between validations (default S/8)")
    p.add_argument("--val-batches", type=int, default=None, help="validation batches (default 8, quick 2)")
    p.add_argument("--batch-size", type=int, default=None, help="per-process batch size (default 16, quick 8)")
    p.add_argument("--max-chars", type=int, default=1_000_000, help="corpus bytes")
    p.add_argument("--d-model", type=int, default=None, help="model width (default 64, quick 32)")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--margin", type=float, default=0.03, help="target = (1 + margin) × best loss reached")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR)
    args = p.parse_args(argv)
    if args.groups < 1 or args.world_size % args.groups:
        p.error(f"--world-size={args.world_size} must be a positive multiple of --groups={args.groups}")
    args.steps = args.steps or (32 if args.quick else 320)
    args.batch_size = args.batch_size or (8 if args.quick else 16)
    args.d_model = args.d_model or (32 if args.quick else 64)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.pbt_interval = args.pbt_interval or max(args.steps // 4, 1)
    args.val_every = args.val_every or max(args.steps // 8, 1)
    args.val_batches = args.val_batches or (2 if args.quick else 8)
    for flag, value in (("--pbt-interval", args.pbt_interval), ("--val-every", args.val_every)):
        if args.steps % value:
            p.error(f"{flag}={value} must divide --steps={args.steps} so every method spends the whole budget")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(NAME, args.quick)
    arms: list[Arm] = []
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for seed in range(args.seeds):
            for start in args.starts:
                arms += run_start(start, args, seed, Path(tmp) / f"seed{seed}" / start.replace(" ", "_"))
    total_s = time.perf_counter() - t0
    target, rows = summarise(arms, args.margin)
    start_lrs = {s: args.good_lr * STARTS[s] for s in args.starts}
    payload = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "target_val_loss": target,
        "total_wall_s": total_s,
        "rows": rows,
        "arms": [vars(a) for a in arms],
    }
    write_json(name, payload, args.results_dir, args.max_chars)
    plot = plot_panels(
        args.docs_dir / "img" / f"{name}.png",
        {
            f"start: {s}": {
                a.method: ([c for c, _, _ in a.curve], [v for _, v, _ in a.curve])
                for a in arms if a.start == s and a.seed == 0 and a.curve
            }
            for s in args.starts
        },
        "compute (rank-steps)",
        "best validation loss so far",
    )
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes, G = {args.groups}, "
        f"S = {args.steps} steps, {args.seeds} seed(s), medians over seeds. Target loss = "
        f"{target:.3f} ((1 + {args.margin}) × best reached). Total wall-clock {total_s:.0f} s.\n\n"
        + table(rows, start_lrs)
        + f"\n\n![{name}](img/{plot.name})\n"
    )
    update_doc_section(args.docs_dir / "benchmarks.md", name, md)
    print(md)
    return payload


if __name__ == "__main__":
    main()
