"""Benchmark 5, the safety net: does HDET survive an LR at which plain DDP fails, on three workloads and for two
kinds of failure?

- **NaN-type**: SGD with momentum 0.9 at an LR where the loss turns NaN/inf (char LM: 1.0, as in benchmark 1;
  shapes CNN: 10);
- **collapse-type**: AdamW at an LR where the loss stays finite but no better than a constant predictor (shapes
  CNN at 0.1: stuck at ln 6, chance level; char LM at 1.0: finite but far above ln 256; tabular MLP at 0.9, 300x
  its good LR: at the labels' prior, every ReLU dead; no NaN case for it).

Arms per workload and failure, all on ``W`` processes with the same seeds and data, ``S`` steps: DDP at the low
(good) LR, DDP at the high LR, and HDET at the high LR as its average, one arm per vote rule of ``--hdet-votes``,
with the published set-up of benchmark 1 (one member per rank, fan-out spread 1/9, gradients averaged over all
ranks, a vote every ``T`` steps, warm start ν = 0.01). Vote names the installed ``HDETCallback`` does not accept
are reported as skipped; ``--default-votes`` arms (``hdet_<arm>_defaults``, named as benchmark 2's arms:
``VOTE[@SYNC][+search]``) run as a user would: the strategy's default multipliers (a 27x geometric grid) and
gradient sync (``group`` unless the arm names one), the callback's defaults but the vote, no warm start; only
``+search`` arms end the search, where ``Search()`` does (a quarter of the run), so ``pbt+search`` is the default
of ``strategy="hdet"`` but for its vote interval (``T``, where the default sizes it to the run: 38 steps of 300).
``defaults[:OPTION=VALUE...]`` (``hdet_defaults...``, benchmark 2's arm) is ``strategy="hdet"`` exactly, interval
included, with those options of ``HDETStrategy`` or ``Search`` changed (e.g. ``defaults:refine_spread=1.0``).
Issue 13's target: HDET's final (merged) model ends below DDP at the low LR (ratio < 1).
Issue 28's price check: HDET ÷ the untuned run (``ddp_high``: plain DDP at the starting LR) and, with ``--full-grid``,
HDET ÷ the best of a full-batch grid from the high LR down to the low one (``grid_xG``, the ceiling; target
≤ 1.5 from 100-300x too high).

Run: ``python benchmarks/crash.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import WORKLOADS, begin, fmt, hdet_callbacks, markdown_table, plot_panels, publish
from benchmarks.hdet_published import add_published_args, fill_published_defaults, run_config
from benchmarks.search_baselines import accepted_votes, defaults_run, is_defaults_arm, parse_hdet_arm
from lightning_hdet.hdet.rules.defaults import DEFAULT_GRADIENT_SYNC, SEARCH_FRACTION

NAME = "crash"
# (workload, failure) -> (optimizer, low LR, high LR); the high LRs were found by single-process sweeps.
FAILURES = {
    ("char_lm", "nan"): ("sgd", 0.1, 1.0),
    ("char_lm", "collapse"): ("adamw", 1e-2, 1.0),
    ("shapes", "nan"): ("sgd", 0.1, 10.0),
    ("shapes", "collapse"): ("adamw", 5e-3, 0.1),
    # The MLP: AdamW at 300x its good LR kills every ReLU within 50 steps and sits at the labels' prior (issue 28).
    ("tabular", "collapse"): ("adamw", 3e-3, 0.9),
}
GRID_POINTS = 4  # --full-grid: DDP runs at this many LRs, geometrically from the high LR down to the low one


def grid_lrs(low: float, high: float, points: int = GRID_POINTS) -> list[float]:
    """``points`` LRs spaced geometrically from ``high`` down to ``low`` (both included)."""
    return [high * (low / high) ** (k / (points - 1)) for k in range(points)]


def run_case(args: argparse.Namespace, workload: str, failure: str, seed: int, work: Path) -> list[dict]:
    """DDP low, DDP high and one HDET arm per vote for one workload, failure and seed; with ``--full-grid`` the grid
    (whose ends are the low and the high LR: DDP low and high are its first and last runs, not run twice)."""
    optimizer, low, high = FAILURES[(workload, failure)]
    case = argparse.Namespace(**{**vars(args), "workload": workload, "seed": seed})

    def row(arm: str, result: dict) -> dict:
        return {"workload": workload, "failure": failure, "arm": arm, "seed": seed, "optimizer": optimizer, **result}

    grid = [run_config(case, lr, optimizer, None, work / f"grid{k}") for k, lr in
            enumerate(grid_lrs(low, high) if args.full_grid else [])]
    ends = {"ddp_low": grid[-1], "ddp_high": grid[0]} if grid else {
        key: run_config(case, lr, optimizer, None, work / key) for key, lr in (("ddp_low", low), ("ddp_high", high))}
    rows = [row(key, result) for key, result in ends.items()]
    rows += [row(f"hdet_{v}", run_config(case, high, optimizer, {"vote": v, "init_noise": 0.01}, work / v))
             for v in args.votes]
    rows += [row(default_arm_name(v), run_default_arm(case, high, optimizer, v, work / f"default_{v}"))
             for v in args.default_votes]
    if grid:  # the ceiling: every LR of the grid on all ranks (GRID_POINTS x the compute), the best one
        best = min(grid, key=lambda r: r["final_val_loss"] if math.isfinite(r["final_val_loss"]) else math.inf)
        rows.append(row("grid_xG", {**best, "grid_lrs": [r["lr"] for r in grid]}))
    return rows


def run_default_arm(args: argparse.Namespace, lr: float, optimizer: str, entry: str, work: Path) -> dict:
    """``entry`` (``VOTE[@SYNC][+search]``, as benchmark 2 names its arms) as a user runs it: the strategy's default
    multipliers (a 27x geometric grid over the groups, one group per rank here), its gradient sync (default
    ``group``), the callback's defaults but the vote, no warm start; ``+search`` ends the search where ``Search()``
    does, at a quarter of the run (``pbt+search`` is ``strategy="hdet"``'s default but for its vote interval, ``T``
    here). ``defaults[:OPTION=VALUE...]``: ``HDETStrategy()`` and ``HDETCallback()`` as benchmark 2's ``defaults``
    arm builds them (:func:`~benchmarks.search_baselines.defaults_options`), only the seed and those options given."""
    from lightning_hdet import HDETStrategy

    if is_defaults_arm(entry):
        strategy, callbacks = defaults_run(entry, args.start_method, args.seed)
        return run_config(args, lr, optimizer, {"entry": entry}, work, strategy=strategy, callbacks=callbacks)
    arm = parse_hdet_arm(entry, DEFAULT_GRADIENT_SYNC)
    strategy = HDETStrategy(gradient_sync=arm.sync, start_method=args.start_method, process_group_backend="gloo")
    callbacks = hdet_callbacks(args.every, vote=arm.vote, signal=arm.signal, seed=args.seed,
                               search_steps=int(args.steps * SEARCH_FRACTION) if arm.search else None)
    return run_config(args, lr, optimizer, {"entry": entry}, work, strategy=strategy, callbacks=callbacks)


def default_arm_name(entry: str) -> str:
    """A ``--default-votes`` arm's row name: ``hdet_pbt+search_defaults``, ``hdet_defaults:refine_spread=1.0``."""
    return f"hdet_{entry}" if is_defaults_arm(entry) else f"hdet_{entry}_defaults"


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def _loss(value: float) -> str:
    """A loss cell: three decimals, or three significant digits for a blown-up loss."""
    return fmt(value) if abs(value) < 1e3 else fmt(value, ".3g")


def _reference(rows: list[dict], workload: str, failure: str, arm: str) -> float | None:
    """The median final loss of ``arm`` in this case (None if it did not run or is not positive)."""
    mine = [r for r in rows if (r["workload"], r["failure"], r["arm"]) == (workload, failure, arm)]
    value = _median(mine, "final_val_loss") if mine else None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def table(rows: list[dict]) -> str:
    headers = ["workload", "failure", "arm", "optimizer, LR", "final val loss (median)", "range over seeds",
               "crashed (seeds)", "non-finite steps", "rescues", "final avg LR", "÷ DDP low LR (< 1)",
               "÷ untuned", "÷ grid ×G (≤ 1.5)"]
    body = []
    cases = list(dict.fromkeys((r["workload"], r["failure"], r["arm"]) for r in rows))
    for workload, failure, arm in cases:
        mine = [r for r in rows if (r["workload"], r["failure"], r["arm"]) == (workload, failure, arm)]
        low = [r for r in rows if (r["workload"], r["failure"], r["arm"]) == (workload, failure, "ddp_low")]
        loss, base = _median(mine, "final_val_loss"), _median(low, "final_val_loss")
        finals = [r["final_val_loss"] for r in mine]
        ratio = loss / base if arm != "ddp_low" and base > 0 else None
        untuned, ceiling = (_reference(rows, workload, failure, a) for a in ("ddp_high", "grid_xG"))
        hdet = arm.startswith("hdet_")
        body.append([
            workload, failure, arm, f"{mine[0]['optimizer']}, {mine[0]['lr']:.3g}", _loss(loss),
            f"{_loss(min(finals))}–{_loss(max(finals))}" if len(finals) > 1 else _loss(finals[0]),
            f"{sum(r['crashed'] for r in mine)}/{len(mine)}", str(sum(r["nonfinite_steps"] for r in mine)),
            str(sum(r["rescues"] for r in mine)), fmt(_median(mine, "final_avg_lr"), ".3g"),
            "—" if ratio is None else f"{_loss(ratio)} {'✓' if ratio < 1 else '✗'}",
            _loss(loss / untuned) if hdet and untuned else "—",
            f"{_loss(loss / ceiling)} {'✓' if loss <= 1.5 * ceiling else '✗'}" if hdet and ceiling else "—",
        ])
    return markdown_table(headers, body)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_published_args(p, quick_steps=8)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS, metavar="WORKLOAD")
    p.add_argument("--failures", nargs="+", default=["nan", "collapse"], choices=("nan", "collapse"), metavar="KIND")
    p.add_argument("--seeds", type=int, default=1, help="seeds --seed, --seed + 1, ... (medians)")
    p.add_argument("--hdet-votes", default="best,softmax", help="comma-separated HDETCallback(vote=...) names")
    p.add_argument("--default-votes", default="",
                   help="comma-separated HDET arms run as a user would (VOTE[@SYNC][+search], as benchmark 2 names "
                   "them): the strategy's default multipliers and gradient sync (group), the callback's defaults but "
                   "the vote, no warm start; pbt+search is the default of strategy='hdet' (but for the vote interval), "
                   "defaults[:OPTION=VALUE...] exactly that with these options of HDETStrategy or Search, e.g. "
                   "pbt+search,trust_region@global,defaults:refine_spread=1.0")
    p.add_argument("--full-grid", action="store_true",
                   help=f"also run plain DDP at {GRID_POINTS} LRs from the high LR down to the low one, on all ranks "
                   f"({GRID_POINTS} x the compute), and report HDET ÷ its best (the ceiling)")
    p.add_argument("--merge", nargs="+", type=Path, default=[], metavar="JSON",
                   help="train nothing: one table from these result files (parts run in parallel, same settings)")
    p.add_argument("--name", default=NAME, help="name of the results file and of the docs block")
    args = p.parse_args(argv)
    fill_published_defaults(p, args, quick_steps=8)
    # Every arm here runs the published set-up, gradients averaged over all ranks.
    args.votes, args.skipped = accepted_votes([v for v in args.hdet_votes.split(",") if v], sync="global")
    args.default_votes, skipped = accepted_votes([v for v in args.default_votes.split(",") if v],
                                                 sync=DEFAULT_GRADIENT_SYNC)
    args.skipped.update(skipped)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(args.name, args.quick)
    rows: list[dict] = []
    if args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        rows = [row for part in parts for row in part["rows"]]
        args.workloads = list(dict.fromkeys(r["workload"] for r in rows))
        args.failures = list(dict.fromkeys(r["failure"] for r in rows))
        seeds = sorted({r["seed"] for r in rows})  # the header counts the parts' seeds, not the command line's
        args.seed, args.seeds = seeds[0], len(seeds)
        total_s = sum(part["total_wall_s"] for part in parts)
    else:
        with tempfile.TemporaryDirectory(prefix=name) as tmp:
            for seed in range(args.seed, args.seed + args.seeds):
                for workload in args.workloads:
                    for failure in [f for f in args.failures if (workload, f) in FAILURES]:
                        rows += run_case(args, workload, failure, seed, Path(tmp) / f"{seed}_{workload}_{failure}")
        total_s = time.perf_counter() - t0
    plot = plot_panels(
        args.docs_dir / "img" / f"{name}.png",
        {f"{w}, {f}": {r["arm"]: ([s for s, _, _ in r["val_curve"]], [v for _, v, _ in r["val_curve"]])
                       for r in rows if (r["workload"], r["failure"], r["seed"]) == (w, f, args.seed)}
         for w in args.workloads for f in args.failures},
        "step", "validation loss (rank 0)", rows=len(args.workloads),
    )
    skipped = "; ".join(f"`{k}`: {v}" for k, v in args.skipped.items()) or "none"
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes, S = {args.steps} steps, HDET "
        f"votes every {args.every} steps, {args.seeds} seed(s) from {args.seed}, medians; skipped votes: {skipped}. "
        f"Final val loss: the final (merged) model on the first {args.val_batches} validation batches; crashed: "
        f"not finite or ≥ 0.99 × the constant predictor's loss. Total wall-clock {total_s:.0f} s.\n\n"
        + table(rows) + f"\n\n![{name}](img/{plot.name})\n"
    )
    args.merge = [str(path) for path in args.merge]
    publish(name, args, {"total_wall_s": total_s, "rows": rows}, md, args.max_chars)
    return {"total_wall_s": total_s, "rows": rows}


if __name__ == "__main__":
    main()
