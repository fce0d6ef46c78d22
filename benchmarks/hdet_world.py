"""Issue 39's group-count table: ``Trainer(strategy="hdet")`` with nothing else set, at W = 4, 8 and 16 processes,
against plain DDP and against one group per rank (``HDETStrategy(num_groups=W)``, the 0.x default).

Every arm trains the same workload for ``S`` steps on ``W`` CPU processes (gloo), each rank reading its own shard of
the training data (Lightning's distributed sampler, as a user's run does), from the good AdamW LR and from 10x too
low. HDET arms take the default callback (vote interval sized to the run, search for the first quarter). Reported:
the validation loss of the model the fit hands back (HDET: the merged model) on the same first validation batches,
and its ratio to plain DDP's at the good LR on the same W (1.00: as good as a run whose LR was right). At W = 4 the
default is one group per rank, so that arm is not run twice.

Run: ``python benchmarks/hdet_world.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.strategies import DDPStrategy

from benchmarks.common import (
    RunSpec,
    add_output_args,
    add_start_method_arg,
    begin,
    fit_run,
    fmt,
    markdown_table,
    publish,
)

NAME = "hdet_world"
#: AdamW's good LR per workload (benchmark 2's; the tabular MLP's is also its default).
GOOD_LR = {"tabular": 3e-3, "shapes": 5e-3}
STARTS = {"good": 1.0, "10x low": 0.1}
ARMS = ("ddp", "default", "per_rank")


def run_arm(arm: str, workload: str, world: int, lr: float, seed: int, args: argparse.Namespace, work: Path) -> dict:
    """One fit; returns its final (merged) model's validation loss, the groups and the votes it held."""
    from lightning_hdet import HDETStrategy

    common = {"start_method": args.start_method, "process_group_backend": "gloo"}
    if arm == "ddp":
        strategy = DDPStrategy(**common)
    else:
        strategy = HDETStrategy(num_groups=world if arm == "per_rank" else None, **common)
    spec = RunSpec(lr=lr, steps=args.steps, seed=seed, devices=world, batch_size=args.batch_size,
                   val_every=args.steps, val_batches=args.val_batches, workload=workload,
                   model={"width": args.width} if workload == "tabular" else {})
    run = fit_run(spec, work, strategy=strategy)
    history = run.rank_extra[0].get("history", []) if run.rank_extra else []
    votes = len({row["step"] for row in history})
    groups = len(run.rank_extra[0]["group_lrs"]) if arm != "ddp" else 1
    return {"arm": arm, "workload": workload, "world": world, "lr": lr, "seed": seed,
            "loss": run.final_model_val_loss, "groups": groups, "votes": votes, "wall_s": run.wall_s}


def table(rows: list[dict], workloads: list[str], worlds: list[int]) -> str:
    """One row per workload and W: DDP's loss at the good LR, then every arm's loss ÷ it (median over seeds)."""
    def loss(workload: str, world: int, arm: str, start: str) -> float | None:
        values = [r["loss"] for r in rows if (r["workload"], r["world"], r["arm"], r["start"]) ==
                  (workload, world, arm, start)]
        return statistics.median(values) if values else None

    def votes(workload: str, world: int) -> str:
        found = sorted({(r["groups"], r["votes"]) for r in rows if (r["workload"], r["world"], r["arm"]) ==
                        (workload, world, "default")})
        return ", ".join(f"{g} × {world // g}, {v} votes" for g, v in found)

    out = []
    for workload in workloads:
        for world in worlds:
            base = loss(workload, world, "ddp", "good")
            ratio = {(arm, start): loss(workload, world, "default" if world <= 4 and arm == "per_rank" else arm,
                                        start) for arm in ARMS for start in STARTS}
            cells = [fmt(None if v is None or base is None else v / base, ".2f") for v in (
                ratio["default", "good"], ratio["per_rank", "good"], ratio["ddp", "10x low"],
                ratio["default", "10x low"], ratio["per_rank", "10x low"])]
            out.append([workload, str(world), votes(workload, world), fmt(base), *cells])
    headers = ["workload", "W", "default: groups × ranks, votes", "DDP good (loss)", "default ÷ DDP, good",
               "per-rank ÷ DDP, good", "DDP 10× low ÷ DDP good", "default 10× low ÷ DDP good",
               "per-rank 10× low ÷ DDP good"]
    return markdown_table(headers, out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p)
    add_start_method_arg(p)
    p.add_argument("--workloads", nargs="+", default=None, choices=list(GOOD_LR), help="default tabular")
    p.add_argument("--worlds", nargs="+", type=int, default=None, help="processes (default 4 8 16, quick 2 4)")
    p.add_argument("--steps", type=int, default=None, help="S (default 300, quick 8)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..n-1")
    p.add_argument("--batch-size", type=int, default=16, help="rows per process")
    p.add_argument("--width", type=int, default=64, help="the tabular MLP's hidden width")
    p.add_argument("--val-batches", type=int, default=8)
    args = p.parse_args(argv)
    args.workloads = args.workloads or ["tabular"]
    args.worlds = args.worlds or ([2, 4] if args.quick else [4, 8, 16])
    args.steps = args.steps or (8 if args.quick else 300)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    name, _ = begin(NAME, args.quick)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for world in args.worlds:
                for seed in range(args.seeds):
                    for start, factor in STARTS.items():
                        for arm in ARMS:
                            if arm == "per_rank" and world <= 4:
                                continue  # the default is one group per rank up to 4 processes
                            row = run_arm(arm, workload, world, GOOD_LR[workload] * factor, seed, args,
                                          Path(tmp) / f"{workload}-{world}-{seed}-{start}-{arm}")
                            rows.append({**row, "start": start})
                            print(f"{workload} W={world} seed={seed} {start} {arm}: loss {row['loss']:.4f} "
                                  f"({row['groups']} groups, {row['votes']} votes, {row['wall_s']:.0f} s)", flush=True)
    markdown = (f"Loss of the handed-back model ÷ plain DDP's at the good LR, same W; S = {args.steps} steps, batch "
                f"{args.batch_size} per process, AdamW, median over {args.seeds} seed(s).\n\n"
                + table(rows, args.workloads, args.worlds))
    publish(name, args, {"rows": rows}, markdown)


if __name__ == "__main__":
    main()
