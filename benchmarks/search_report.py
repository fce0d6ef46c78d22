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
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path

if __package__ in (None, ""):  # run as a script (issue 59's table over result files): the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
        # a baseline that diverged in most seeds has no median loss (None): no ratio to it, and it is no one's best
        baselines = {m: r["best_val_loss"] for m, r in by_method.items()
                     if m in BASELINE_LABELS and r["best_val_loss"] is not None}
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
                others = [a.best_val_loss for m, a in mine.items()
                          if m in BASELINE_LABELS and a.best_val_loss is not None]
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
    out["handed_back"] = handed_back_rows(arms, args.votes, {"optimizer": args.optimizer, "schedule": args.schedule})
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
OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD + momentum 0.9", "schedulefree": "schedule-free AdamW", "prodigy": "Prodigy (its lr multiplier)"}


def settings(summary: dict, args: argparse.Namespace, total_s: float) -> str:
    """One paragraph: the run's sizes, the target loss, what was skipped, the wall-clock."""
    targets = ", ".join(f"{w} {v:.3f}" for w, v in summary["targets_val_loss"].items())
    skipped = "; ".join(f"`{k}`: {v}" for k, v in summary["skipped"].items()) or "none"
    return (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes, G = {args.groups}, "
        f"S = {args.steps} steps, T = {args.pbt_interval} (PBT interval, HDET vote interval), validation every "
        f"{args.val_every} steps on {args.val_batches} batches, batch {args.batch_size} per process, "
        f"{args.seeds} seed(s), medians over seeds; LRs searched for {OPTIMIZER_NAMES[args.optimizer]}, "
        f"{args.schedule} schedule. Target "
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
        + (f"\n\n{HANDED_BACK_NOTE}\n\n{handed_back_table(summary['handed_back'], _good(args))}"
           if summary["handed_back"] else "")
        + (f"\n\n{others}" if (others := baselines_table(summary["handed_back"])) else "")
    )


def _good(args: argparse.Namespace) -> dict[tuple[str, str, str], float]:
    return {(w, args.optimizer, args.schedule): lr for w, lr in args.good_lr.items()}


def page_table(summary: dict, args: argparse.Namespace, total_s: float) -> str:
    """The results page's block: settings and the insurance table (median best validation loss per arm)."""
    return (
        settings(summary, args, total_s) + "\n\nMedian best validation loss of each arm; ✓ / ✗ against issue 28's "
        "target where it applies (good start: ÷ untuned ≤ 1.02; 10× off: ÷ grid ×G ≤ 1.05).\n\n"
        + _insurance_table(summary)
    )


# Issue 59's targets on the held-out loss of the handed-back model (``Arm.final_loss``), per start: the ratio each
# start is judged by and its bound on the median over seeds (and, from the good start, on the worst seed).
# "grid best": plain DDP at the grid's best LR (the untuned arm of the good start, same seed).
TARGETS_59 = {"good": ("untuned", 1.02, 1.10), "10x high": ("grid_best", 1.05, None),
              "10x low": ("grid_best", 1.05, None), "40x high": ("grid_best", 1.15, None),
              "40x low": ("grid_best", 1.15, None)}
LR_FIND_BOUND = 1.0  # at equal compute, at or below lr_find + DDP from every start


def handed_back_rows(arms: list, votes: list[str], label: dict) -> list[dict]:
    """Issue 59's targets per workload, start and HDET arm: per seed HDET's handed-back held-out loss ÷ the untuned
    run's (same start), ÷ plain DDP at the grid's best LR (the good start's untuned run) and ÷ ``lr_find`` + DDP
    (same start); each as its median and worst (largest) over seeds. ``label`` (optimizer, schedule) is copied in."""
    out = []
    for workload in dict.fromkeys(a.workload for a in arms):
        for start in dict.fromkeys(a.start for a in arms if a.workload == workload):
            for vote in votes:
                ratios: dict[str, list[float]] = {"untuned": [], "grid_best": [], "lr_find": [],
                                                  **{m: [] for m in OTHER_BASELINES}}
                hdet_losses, finder_lrs, pbt_seeds = [], [], 0
                for seed in sorted({a.seed for a in arms}):
                    mine = {a.method: a for a in arms if (a.workload, a.start, a.seed) == (workload, start, seed)}
                    hdet = mine.get(f"hdet_{vote}")
                    if hdet is None or not math.isfinite(hdet.final_loss):
                        continue
                    hdet_losses.append(hdet.final_loss)
                    best = next((a for a in arms if (a.workload, a.start, a.seed, a.method)
                                 == (workload, "good", seed, "untuned")), None)
                    for key, other in (("untuned", mine.get("untuned")), ("grid_best", best),
                                       ("lr_find", mine.get("lr_find")), *((m, mine.get(m)) for m in OTHER_BASELINES)):
                        if other is not None and math.isfinite(other.final_loss) and other.final_loss > 0:
                            ratios[key].append(hdet.final_loss / other.final_loss)
                    if "lr_find" in mine:
                        finder_lrs.append(mine["lr_find"].settled_lr)
                    pbt_seeds += "pbt" in mine
                if not hdet_losses:
                    continue
                out.append({**label, "workload": workload, "start": start, "vote": vote,
                            "hdet_final_loss": median(hdet_losses), "seeds": len(hdet_losses),
                            "lr_find_lr": median(finder_lrs) if finder_lrs else None, "seeds_pbt": pbt_seeds,
                            **{f"vs_{k}": median(v) if v else None for k, v in ratios.items()},
                            **{f"vs_{k}_worst": max(v) if v else None for k, v in ratios.items()}})
    return out


def _cell(row: dict, key: str, bound: float | None, worst_bound: float | None) -> str:
    """``median (worst seed)`` with ✓ / ✗ where a target applies (both bounds met)."""
    med, worst = row[f"vs_{key}"], row[f"vs_{key}_worst"]
    if med is None:
        return "—"
    text = f"{med:.3f} ({worst:.3f})"
    if bound is None:
        return text
    ok = med <= bound and (worst_bound is None or worst <= worst_bound)
    return f"{text} {'✓' if ok else '✗'}"


def handed_back_table(rows: list[dict], good_lr: dict[tuple[str, str, str], float] | None = None) -> str:
    """Issue 59's targets table: HDET ÷ untuned (the good start's target: median ≤ 1.02, worst seed ≤ 1.10), ÷
    grid best (10x off ≤ 1.05, 40x off ≤ 1.15), ÷ ``lr_find`` + DDP (≤ 1 everywhere); medians of seeds with the
    worst seed in brackets. ``good_lr`` (workload, optimizer, schedule) -> the grid's best LR, to show the finder's
    suggestion as a multiple of it."""
    headers = ["workload", "optimizer", "schedule", "start", "HDET arm", "HDET loss (median)",
               "÷ untuned (worst)", "÷ grid best (worst)", "÷ lr_find + DDP (worst)", "lr_find LR ÷ best LR", "seeds"]
    body = []
    for r in rows:
        key, bound, worst_bound = TARGETS_59.get(r["start"], (None, None, None))
        best_lr = (good_lr or {}).get((r["workload"], r["optimizer"], r["schedule"]))
        body.append([
            r["workload"], r["optimizer"], r["schedule"], r["start"], r["vote"], fmt(r["hdet_final_loss"]),
            _cell(r, "untuned", bound if key == "untuned" else None, worst_bound),
            _cell(r, "grid_best", bound if key == "grid_best" else None, None),
            _cell(r, "lr_find", LR_FIND_BOUND, None),
            "—" if r["lr_find_lr"] is None or best_lr is None else f"{r['lr_find_lr'] / best_lr:.2g}",
            str(r["seeds"]),
        ])
    return markdown_table(headers, body)


HANDED_BACK_NOTE = (
    "Issue 59's targets on the held-out loss of the model each run hands back (HDET: the merged model), medians "
    "over seeds with the worst seed in brackets; ✓ / ✗ where a target applies: from the good start ÷ untuned ≤ 1.02 "
    "(worst seed ≤ 1.10); from 10× off ÷ grid best (plain DDP at the grid's best LR, same seed) ≤ 1.05, from 40× off "
    "≤ 1.15; ÷ `lr_find` + DDP ≤ 1 from every start (equal compute: the finder's 100 steps counted).")


def baselines_table(rows: list[dict]) -> str:
    """HDET's handed-back held-out loss ÷ each other baseline's that ran (the grid's best run, TPE's best trial,
    PBT's best member, Prodigy, schedule-free AdamW; same start and seed), median over seeds (worst seed): issue 59's
    item 4 beside the targets table. Empty when none of them ran."""
    shown = [m for m in OTHER_BASELINES if any(r.get(f"vs_{m}") is not None for r in rows)]
    if not shown:
        return ""
    headers = ["workload", "optimizer", "start", "HDET arm", "HDET loss", *[f"÷ {BASELINE_LABELS[m]} (worst)" for m in shown],
               "seeds (PBT)"]
    body = []
    for r in rows:
        pbt = r.get("seeds_pbt")
        body.append([r["workload"], r["optimizer"], r["start"], r["vote"], fmt(r["hdet_final_loss"]),
                     *[_cell(r, m, None, None) for m in shown], f"{r['seeds']}" + (f" ({pbt})" if pbt else "")])
    return BASELINES_NOTE + "\n\n" + markdown_table(headers, body)


# Issue 59's item 4: the baselines beside lr_find, on the handed-back model (grid: its run of the lowest held-out loss).
OTHER_BASELINES = ("grid", "optuna_tpe", "pbt", "prodigy", "schedulefree")
BASELINES_NOTE = (
    "HDET's handed-back held-out loss ÷ each other baseline's at equal compute, same start and seed, median over seeds "
    "(worst seed in brackets; below 1: HDET better). Grid: its run of the lowest held-out loss; TPE: the trial of the "
    "lowest validation loss; PBT (Ray Tune): the member that ended best; Prodigy (lr 1) and schedule-free AdamW (at "
    "the starting LR): one run on the whole job's batch.")


def load_cells(paths: list[Path]) -> tuple[dict[tuple[str, str], tuple[list, list[str]]], dict, set[int], float]:
    """The arms of benchmark 2's result files grouped by (optimizer, schedule), with each group's HDET votes; the
    good LRs, seeds and summed wall-clock. A baseline arm (same workload, start, seed and method) is taken from the
    first file that has it, so a file of HDET arms alone (``--methods`` with nothing) is read against an earlier
    file's baselines. Where several files of one group hold HDET arms, each file's are named ``VOTE [file stem]``
    (an old and a new ``defaults`` side by side) when those files share a workload."""
    from benchmarks.search_baselines import Arm

    loaded = [(path, json.loads(path.read_text())) for path in paths]
    label_of = {path: (d["config"]["optimizer"], d["config"].get("schedule", "constant")) for path, d in loaded}
    hdet_cells = {path: {(*label_of[path], a["workload"]) for a in d["arms"] if a["method"].startswith("hdet_")}
                  for path, d in loaded}
    groups: dict[tuple[str, str], tuple[dict, list[str]]] = {}
    good, seeds, wall = {}, set(), 0.0
    for path, data in loaded:
        label = label_of[path]
        cells, votes = groups.setdefault(label, ({}, []))
        shared = any(hdet_cells[path] & cells_of for other, cells_of in hdet_cells.items() if other != path)
        tag = f" [{path.stem}]" if shared else ""
        for raw in data["arms"]:
            arm = Arm(**raw)
            if arm.method.startswith("hdet_"):
                arm.method += tag
                vote = arm.method.removeprefix("hdet_")
                votes += [] if vote in votes else [vote]
                cells[(arm.workload, arm.start, arm.seed, arm.method)] = arm
            else:
                cells.setdefault((arm.workload, arm.start, arm.seed, arm.method), arm)
            seeds.add(arm.seed)
        wall += data.get("total_wall_s", 0.0)
        good.update({(w, *label): lr for w, lr in data["config"]["good_lr"].items()})
    return {k: (list(cells.values()), votes) for k, (cells, votes) in groups.items()}, good, seeds, wall


def main(argv: list[str] | None = None) -> str:
    """Issue 59's targets table over benchmark 2's result files (see :func:`load_cells`), printed and written to
    ``--out`` (markdown) with a stamp."""
    from benchmarks.common import DOCS_DIR, stamp, write_block

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="search_baselines result files (JSON)")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    p.add_argument("--block", default=None, metavar="NAME",
                   help="also write it as the docs block NAME (search_repeat*: the research log)")
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR)
    args = p.parse_args(argv)
    groups, good, seeds, wall = load_cells(args.results)
    rows = [row for (optimizer, schedule), (arms, votes) in groups.items()
            for row in handed_back_rows(arms, votes, {"optimizer": optimizer, "schedule": schedule})]
    others = baselines_table(rows)
    text = (HANDED_BACK_NOTE + "\n\n" + handed_back_table(rows, good) + (f"\n\n{others}" if others else "")
            + "\n\nFrom: "
            + ", ".join(f"`{p.as_posix()}`" for p in args.results) + "\n\n" + stamp(seeds, wall_s=wall))
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.block is not None:
        write_block(args.docs_dir, args.block, text)
    print(text)
    return text


if __name__ == "__main__":
    main()
