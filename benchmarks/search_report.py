"""Benchmark 2's summary: medians and spread over seeds per method, and issue 13's targets as ratios.

Targets (issue 13), per workload, start and HDET vote rule:

- HDET's median best validation loss ≤ that of every baseline (ratio ≤ 1), the untuned run (issue 28's price
  check: plain DDP at the starting LR), grid, TPE, PBT, Prodigy and schedule-free at equal compute;
- HDET's settled LR within 2× of the best grid LR (ratio in [0.5, 2]; median over seeds of the per-seed ratio);
- one HDET run over G LRs ≤ 1.02 × the best loss of a grid of G runs each as large as the whole HDET job
  (``grid_xG``, only with ``--full-grid``), i.e. at 1/G of that grid's compute.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

from benchmarks.common import fmt, markdown_table, median

BASELINE_LABELS = {"untuned": "untuned", "grid": "grid", "optuna_tpe": "TPE", "pbt": "PBT (Ray)", "pbt_minimal": "PBT (minimal)",
                   "prodigy": "Prodigy", "schedulefree": "SF"}


def to_target(curve: list[tuple[int, float, float]], target: float) -> tuple[int | None, float | None]:
    """First ``(compute, deployed seconds)`` on a best-so-far curve at or below ``target``."""
    return next(((c, s) for c, loss, s in curve if loss <= target), (None, None))


def _spread(values: Iterable[float]) -> str:
    """``min–max`` over seeds (a single value for one seed)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "—"
    return fmt(min(vals)) if len(vals) == 1 else f"{min(vals):.3f}–{max(vals):.3f}"


def _method_rows(arms: list, workload: str, methods: list[str], starts: dict, target: float) -> list[dict]:
    rows = []
    for start in starts:
        for method in methods:
            group = [a for a in arms if a.workload == workload and a.start == start and a.method == method]
            if not group:
                continue
            hits = [to_target(a.curve, target) for a in group]
            rows.append({
                "workload": workload, "start": start, "method": method,
                "best_val_loss": median(a.best_val_loss for a in group),
                "best_val_loss_range": _spread(a.best_val_loss for a in group),
                "settled_lr": median(a.settled_lr for a in group),
                "rank_steps_to_target": median(h[0] for h in hits),
                "deployed_s_to_target": median(h[1] for h in hits),
                "wall_s": median(a.wall_s for a in group),
                "diverged_runs": sum(a.diverged_runs for a in group),
                "seeds": len(group),
            })
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def _target_rows(arms: list, rows: list[dict], workload: str, starts: dict, votes: list[str]) -> list[dict]:
    out = []
    for start in starts:
        by_method = {r["method"]: r for r in rows if r["workload"] == workload and r["start"] == start}
        baselines = {m: r["best_val_loss"] for m, r in by_method.items() if m in BASELINE_LABELS}
        for vote in votes:
            hdet = by_method.get(f"hdet_{vote}")
            if hdet is None:
                continue
            loss = hdet["best_val_loss"]
            per_seed, lr_ratios = [], []
            for seed in sorted({a.seed for a in arms}):
                mine = {a.method: a for a in arms if (a.workload, a.start, a.seed) == (workload, start, seed)}
                if f"hdet_{vote}" not in mine:
                    continue
                h = mine[f"hdet_{vote}"]
                others = [a.best_val_loss for m, a in mine.items() if m in BASELINE_LABELS]
                per_seed.append(_ratio(h.best_val_loss, min(others)) if others else None)
                if "grid" in mine:
                    lr_ratios.append(h.settled_lr / mine["grid"].settled_lr)
            full = by_method.get("grid_xG")
            out.append({
                "workload": workload, "start": start, "vote": vote, "best_val_loss": loss,
                "vs": {m: _ratio(loss, v) for m, v in baselines.items()},
                "vs_best_baseline": _ratio(loss, min(baselines.values())) if baselines else None,
                "vs_best_baseline_per_seed": per_seed,
                "lr_vs_grid": median(lr_ratios) if lr_ratios else None,
                "lr_vs_grid_per_seed": lr_ratios,
                "vs_grid_xG": _ratio(loss, full["best_val_loss"]) if full else None,
            })
    return out


def summarise(arms: list, args: argparse.Namespace, starts: dict) -> dict:
    """Per workload: the target loss ((1 + margin) × the best loss any equal-compute method reached), one row
    per (start, method) and one row of target ratios per (start, vote)."""
    out: dict = {"targets_val_loss": {}, "rows": [], "targets": [], "skipped": args.skipped}
    for workload in args.workloads:
        mine = [a for a in arms if a.workload == workload]
        reached = [a.best_val_loss for a in mine if math.isfinite(a.best_val_loss) and a.method != "grid_xG"]
        target = (1 + args.margin) * min(reached) if reached else math.inf
        rows = _method_rows(mine, workload, args.run_methods, starts, target)
        out["targets_val_loss"][workload] = target
        out["rows"] += rows
        out["targets"] += _target_rows(mine, rows, workload, starts, args.votes)
    return out


def _flag(value: float | None, ok: bool) -> str:
    return "—" if value is None else f"{value:.3f} {'✓' if ok else '✗'}"


def _methods_table(summary: dict, starts: dict, good_lr: dict) -> str:
    headers = ["workload", "start (LR)", "method", "best val loss (median)", "range over seeds", "settled LR",
               "rank-steps to target", "deployed s to target", "wall s", "diverged runs", "seeds"]
    body = []
    for r in summary["rows"]:
        lr = good_lr[r["workload"]] * starts[r["start"]]
        body.append([
            r["workload"], f"{r['start']} ({lr:.2g})", r["method"], fmt(r["best_val_loss"]),
            r["best_val_loss_range"], fmt(r["settled_lr"], ".2g"), fmt(r["rank_steps_to_target"], ".0f"),
            fmt(r["deployed_s_to_target"], ".1f"), fmt(r["wall_s"], ".1f"), str(r["diverged_runs"]), str(r["seeds"]),
        ])
    return markdown_table(headers, body)


def _targets_table(summary: dict) -> str:
    shown = [m for m in BASELINE_LABELS if any(m in t["vs"] for t in summary["targets"])]
    headers = ["workload", "start", "HDET vote", "HDET best val loss",
               *[f"÷ {BASELINE_LABELS[m]}" for m in shown], "÷ best baseline (≤ 1)", "per seed",
               "settled LR ÷ best grid LR (0.5–2)", "÷ grid ×G (≤ 1.02)"]
    body = []
    for t in summary["targets"]:
        lr = t["lr_vs_grid"]
        body.append([
            t["workload"], t["start"], t["vote"], fmt(t["best_val_loss"]),
            *[fmt(t["vs"].get(m)) for m in shown],
            _flag(t["vs_best_baseline"], (t["vs_best_baseline"] or math.inf) <= 1.0),
            _spread(t["vs_best_baseline_per_seed"]),
            "—" if lr is None else f"{lr:.2f} {'✓' if 0.5 <= lr <= 2 else '✗'}",
            _flag(t["vs_grid_xG"], (t["vs_grid_xG"] or math.inf) <= 1.02),
        ])
    return markdown_table(headers, body)


def _insurance_table(summary: dict) -> str:
    """The results page's table: per workload, start and HDET arm, its loss against the untuned run, the best
    other method at equal compute and the G x-compute grid, with issue 28's targets flagged where they apply (good
    start: ÷ untuned ≤ 1.02; 10x off: ÷ grid ×G ≤ 1.05)."""
    rows = {(r["workload"], r["start"], r["method"]): r for r in summary["rows"]}
    headers = ["workload", "start", "HDET arm", "HDET", "untuned", "best other (equal compute)", "grid ×G",
               "÷ untuned", "÷ best other", "÷ grid ×G", "seeds"]
    body = []
    for t in summary["targets"]:
        key = (t["workload"], t["start"])
        others = {m: r["best_val_loss"] for (w, s, m), r in rows.items()
                  if (w, s) == key and m in BASELINE_LABELS and m != "untuned"}
        best = min(others, key=others.get) if others else None
        untuned, full = rows.get((*key, "untuned")), rows.get((*key, "grid_xG"))
        good = t["start"] == "good"
        body.append([
            t["workload"], t["start"], t["vote"], fmt(t["best_val_loss"]),
            fmt(untuned and untuned["best_val_loss"]), "—" if best is None else f"{fmt(others[best])} ({BASELINE_LABELS[best]})",
            fmt(full and full["best_val_loss"]),
            _flag(t["vs"].get("untuned"), (t["vs"].get("untuned") or math.inf) <= 1.02) if good
            else fmt(t["vs"].get("untuned")),
            fmt(_ratio(t["best_val_loss"], others.get(best))),
            fmt(t["vs_grid_xG"]) if good else _flag(t["vs_grid_xG"], (t["vs_grid_xG"] or math.inf) <= 1.05),
            str(rows[(*key, f"hdet_{t['vote']}")]["seeds"]),
        ])
    return markdown_table(headers, body)


# How the table names the optimizer whose LR grid, TPE, PBT and HDET search (``--optimizer``).
OPTIMIZER_NAMES = {"adamw": "AdamW", "schedulefree": "schedule-free AdamW", "prodigy": "Prodigy (its lr multiplier)"}


def settings(summary: dict, args: argparse.Namespace, total_s: float) -> str:
    """One paragraph: the run's sizes, the target loss, what was skipped, the wall-clock."""
    targets = ", ".join(f"{w} {v:.3f}" for w, v in summary["targets_val_loss"].items())
    skipped = "; ".join(f"`{k}`: {v}" for k, v in summary["skipped"].items()) or "none"
    return (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes, G = {args.groups}, "
        f"S = {args.steps} steps, T = {args.pbt_interval} (PBT interval, HDET vote interval), validation every "
        f"{args.val_every} steps on {args.val_batches} batches, batch {args.batch_size} per process, "
        f"{args.seeds} seed(s), medians over seeds; LRs searched for {OPTIMIZER_NAMES[args.optimizer]}. Target "
        f"loss ((1 + {args.margin}) × best reached at equal compute): {targets}. Skipped: {skipped}. Total "
        f"wall-clock {total_s:.0f} s."
    )


def tables(summary: dict, args: argparse.Namespace, starts: dict, total_s: float) -> str:
    """Every table of the run: settings, the methods table and the targets table (the research log's block)."""
    return (
        settings(summary, args, total_s) + "\n\n"
        + _methods_table(summary, starts, args.good_lr)
        + "\n\nIssue 13's targets, HDET's median best validation loss divided by each baseline's (≤ 1 means HDET is "
        "at least as good), per seed the range of HDET ÷ that seed's best baseline; ✓ / ✗ against the target.\n\n"
        + _targets_table(summary)
    )


def page_table(summary: dict, args: argparse.Namespace, total_s: float) -> str:
    """The results page's block: settings and the insurance table (median best validation loss per arm)."""
    return (
        settings(summary, args, total_s) + "\n\nMedian best validation loss of each arm; ✓ / ✗ against issue 28's "
        "target where it applies (good start: ÷ untuned ≤ 1.02; 10× off: ÷ grid ×G ≤ 1.05).\n\n"
        + _insurance_table(summary)
    )
