"""How many votes does the search need? The measurement behind ``defaults.VOTES_IN_SEARCH`` (issue 39).

``Trainer(strategy="hdet")`` on W processes (the default groups and grid) with ``HDETCallback(every_n_steps=T)``
for several T, on a short and a longer run of the tabular MLP, from AdamW's good LR and from 10x too low. The search
ends at the first vote from a quarter of the run on, so T sets the votes in the search (``ceil(S / 4 / T)``) and the
votes after it. Reported: the handed-back (merged) model's validation loss, median over seeds, and its ratio to plain
DDP's at the good LR on the same run.

Run: ``python benchmarks/hdet_votes.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.strategies import DDPStrategy

from benchmarks.common import RunSpec, add_output_args, add_start_method_arg, begin, fit_run, fmt, markdown_table, \
    publish
from benchmarks.hdet_world import GOOD_LR, STARTS

NAME = "hdet_votes"
#: Votes in the search (a quarter of the run) the table compares.
IN_SEARCH = (1, 2, 4, 8)


def interval(steps: int, votes: int) -> int:
    """The interval that puts ``votes`` votes in the first quarter of a run of ``steps`` steps."""
    return max(1, math.ceil(steps / 4 / votes))


def run(steps: int, every: int | None, lr: float, seed: int, args: argparse.Namespace, work: Path) -> float:
    """The handed-back model's validation loss: HDET voting every ``every`` steps, or plain DDP (``None``)."""
    from lightning_hdet import HDETCallback, HDETStrategy

    common = {"start_method": args.start_method, "process_group_backend": "gloo"}
    strategy = DDPStrategy(**common) if every is None else HDETStrategy(**common)
    spec = RunSpec(lr=lr, steps=steps, seed=seed, devices=args.world_size, batch_size=args.batch_size,
                   val_every=steps, val_batches=args.val_batches, workload="tabular", model={"width": args.width})
    callbacks = [] if every is None else [HDETCallback(every_n_steps=every)]
    return fit_run(spec, work, strategy=strategy, callbacks=callbacks).final_model_val_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p)
    add_start_method_arg(p)
    p.add_argument("--runs", nargs="+", type=int, default=None, help="run lengths S (default 80 300, quick 16)")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..n-1 (default 2, quick 1)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--val-batches", type=int, default=8)
    args = p.parse_args(argv)
    args.runs = args.runs or ([16] if args.quick else [80, 300])
    args.seeds = args.seeds or (1 if args.quick else 2)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    name, _ = begin(NAME, args.quick)
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for steps in args.runs:
            for seed in range(args.seeds):
                ddp = run(steps, None, GOOD_LR["tabular"], seed, args, Path(tmp) / "ddp")
                for start, factor in STARTS.items():
                    for votes in IN_SEARCH:
                        every = interval(steps, votes)
                        loss = run(steps, every, GOOD_LR["tabular"] * factor, seed, args, Path(tmp) / f"{votes}")
                        rows.append({"steps": steps, "start": start, "votes_in_search": votes, "every": every,
                                     "seed": seed, "loss": loss, "ddp_good": ddp})
                        print(f"S={steps} {start} seed={seed} T={every}: {loss:.4f} (DDP good {ddp:.4f})", flush=True)
            for start in STARTS:
                ratios = [[r["loss"] / r["ddp_good"] for r in rows if (r["steps"], r["start"], r["votes_in_search"])
                           == (steps, start, v)] for v in IN_SEARCH]
                lines.append([str(steps), start] + [fmt(statistics.median(x), ".3f") for x in ratios])
    headers = ["S", "start"] + [f"{v} in search (T = S/{4 * v})" for v in IN_SEARCH]
    markdown = (f"The merged model's validation loss ÷ plain DDP's at the good LR (same run length and seed), median "
                f"over {args.seeds} seed(s); W = G = {args.world_size}, tabular MLP (width {args.width}), AdamW, "
                f"batch {args.batch_size} per process.\n\n" + markdown_table(headers, lines))
    publish(name, args, {"rows": rows}, markdown)


if __name__ == "__main__":
    main()
