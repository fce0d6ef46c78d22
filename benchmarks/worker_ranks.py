"""Workers of several ranks at equal samples: 2 workers x k ranks (``ranks_per_worker=k``, DDP inside each
worker; k = 2 by default) against 2k workers of one rank, async and DiLoCo, and DDP over the same 2k processes,
on the same seed, data and per-rank batch (so the same samples: ``max_steps`` is a sample budget either way).

Reported: the final global model's validation loss per seed, and the ratio of 2 x k to 2k x 1 (issue 42's
target: within 1 %). Runs share 2 CPU cores with other jobs: wall-clock is not compared.

Run: ``python benchmarks/worker_ranks.py [--quick] [--workload tabular] [--seeds 0 1 2] [--ranks-per-worker k]
[--inside-worker fsdp]`` (prints a markdown table; ``fsdp``: the 2 x k arms shard each worker's model with FSDP2). ``BENCH_ACCELERATOR=cuda`` trains on the GPU (every rank on ``cuda:0`` over gloo), with
``BENCH_BACKEND=nccl`` one GPU per rank over NCCL (2k GPUs), as in ``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RunSpec, adaptive_rounds, add_start_method_arg, begin, fit_run, fmt, markdown_table, stamp

NAME = "worker_ranks"
#: arm -> (mode, several ranks per worker); ``None``: DDP.
ARMS = {"ddp": None, "async": ("async", False), "async ranks": ("async", True), "diloco": ("sync", False),
        "diloco ranks": ("sync", True)}


def label(arm: str, k: int) -> str:
    """The arm as the table shows it: ``async 4x1``, ``async 2x2``, ..."""
    setting = ARMS[arm]
    if setting is None:
        return f"ddp over {2 * k}"
    return f"{arm.split()[0]} {'2x' + str(k) if setting[1] else str(2 * k) + 'x1'}"


def label_inside(arm: str, k: int, inside: str) -> str:
    """:func:`label`, with what runs inside a worker of several ranks when it is not DDP (``async 2x2 fsdp``)."""
    return label(arm, k) + (f" {inside}" if inside != "ddp" and (ARMS[arm] or (None, False))[1] else "")


def run_arm(arm: str, seed: int, args: argparse.Namespace, work: Path) -> float:
    """One fit of ``arm`` on 2k processes; the final (global) model's validation loss."""
    from lightning_hdet import AsyncLocalSGDStrategy, WorkerShape

    common = {"start_method": args.start_method, "process_group_backend": os.environ.get("BENCH_BACKEND", "gloo")}
    setting, k = ARMS[arm], args.ranks_per_worker
    if setting is None:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(**common)
    else:
        mode, several = setting
        inside = {"inside_worker": args.inside_worker} if several else {}
        worker = WorkerShape(ranks_per_worker=k if several else 1, **inside)
        strategy = AsyncLocalSGDStrategy(local_steps=adaptive_rounds(args.local_steps, mode), mode=mode, worker=worker,
                                         **common)
    spec = RunSpec(lr=args.lr, steps=args.steps, seed=seed, devices=2 * k, batch_size=args.batch_size,
                   val_every=args.steps, val_batches=8, workload=args.workload)
    return fit_run(spec, work, strategy=strategy).final_model_val_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", default="tabular", choices=("tabular", "shapes", "char_lm"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="max_steps (per rank, as in DDP)")
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--ranks-per-worker", type=int, default=2, help="k: 2 workers of k ranks, 2k processes")
    parser.add_argument("--inside-worker", default="ddp", choices=("ddp", "fsdp"),
                        help="what runs inside each worker of the 2 x k arms")
    parser.add_argument("--out", type=Path, default=None, help="also write the losses as JSON here")
    add_start_method_arg(parser)
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.quick else 200)
    begin(NAME, args.quick)
    losses: dict[str, list[float]] = {arm: [] for arm in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in args.arms:  # interleaved: a load change on the machine hits every arm alike
                losses[arm].append(run_arm(arm, seed, args, Path(tmp) / f"{arm.replace(' ', '_')}_{seed}"))
                print(f"seed {seed} {label_inside(arm, args.ranks_per_worker, args.inside_worker)}:"
                      f" {losses[arm][-1]:.4f}", flush=True)
    rows = []
    for arm in args.arms:
        base = arm.replace(" ranks", "")
        ratio = [a / b for a, b in zip(losses[arm], losses[base])] if arm != base and base in losses else []
        rows.append([label_inside(arm, args.ranks_per_worker, args.inside_worker), *[fmt(x) for x in losses[arm]],
                     " / ".join(f"{r:.3f}" for r in ratio) or "—"])
    header = ["arm", *[f"seed {s}" for s in args.seeds], "÷ one rank per worker"]
    print(markdown_table(header, rows))
    print(f"\n{args.workload}, {args.steps} steps per rank, batch {args.batch_size} per rank, H = {args.local_steps},"
          f" lr {args.lr}\n\n{stamp(args.seeds)}")
    if args.out is not None:
        args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "losses": losses}))


if __name__ == "__main__":
    main()
