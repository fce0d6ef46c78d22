"""Bytes to a loss: what each exchange sends, and what a slow link makes of it (issue 43's benchmark; the
``overlap`` arms train ``--overlap-steps`` inner steps while each exchange travels, the others block).

Arms on W processes, the same seed, data and per-rank batch: DDP (its ring all-reduce sends ``2 (W - 1) / W``
float32 models per rank and step, counted, not emulated), DiLoCo and async with each push codec. For the Local-SGD
arms the bytes are those the outer side counted (pushes after compression) plus the pulls (the float32 model per
reply). At each link speed (``--links``, bits per second; 0: loopback, no emulation) every worker but rank 0's sits
behind a :class:`~lightning_hdet.testing.SlowLink`. Reported: total bytes, bytes ÷ DDP's, the final global model's
validation loss ÷ DiLoCo-f32's, and wall-clock (loaded machine: compare within one run only).

Run: ``python benchmarks/comm_bytes.py [--quick] [--workload char_lm] [--seeds 0] [--links 0 1e8]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    RunSpec,
    add_output_args,
    add_start_method_arg,
    begin,
    build_workload,
    fit_run,
    fmt,
    markdown_table,
    publish,
)

NAME = "comm_bytes"
#: arm -> (mode, push codec, overlapped); ``None``: DDP.
ARMS = {"ddp": None, "diloco f32": ("sync", "none", False), "diloco int8": ("sync", "int8", False),
        "diloco topk2": ("sync", "topk2", False), "async f32": ("async", "none", False),
        "async topk2": ("async", "topk2", False), "diloco f32 overlap": ("sync", "none", True),
        "async f32 overlap": ("async", "none", True)}


def run_arm(arm: str, seed: int, link: float, args: argparse.Namespace, work: Path) -> dict:
    """One fit; its final loss, bytes sent in all and wall-clock."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import AsyncLocalSGDStrategy, SlowLink

    setting = ARMS[arm]
    spec = RunSpec(lr=args.lr, steps=args.steps, seed=seed, devices=args.workers, batch_size=args.batch_size,
                   val_every=args.steps, val_batches=8, workload=args.workload)
    if setting is None:
        strategy = DDPStrategy(start_method=args.start_method, process_group_backend="gloo")
        callbacks = []
    else:
        strategy = AsyncLocalSGDStrategy(local_steps=args.local_steps, mode=setting[0], compression=setting[1],
                                         overlap_steps=args.overlap_steps if setting[2] else 0,
                                         start_method=args.start_method)
        callbacks = [SlowLink(bits_per_s=link)] if link > 0 else []
    result = fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    n_params = sum(p.numel() for p in build_workload(spec)[0].parameters())
    if setting is None:  # ring all-reduce: 2 (W - 1) / W models per rank and step, on every rank
        sent = 2 * (args.workers - 1) * 4 * n_params * args.steps
    else:
        stats = result.rank_extra[0]["worker_stats"]
        pulls = sum(s["rounds"] + 1 for s in stats.values())  # a reply per push, and one to the hello
        sent = sum(s["push_bytes"] for s in stats.values()) + pulls * 4 * n_params
    return {"loss": result.final_model_val_loss, "bytes": sent, "wall_s": result.wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(parser)
    parser.add_argument("--workload", default="char_lm", choices=("tabular", "shapes", "char_lm"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="max_steps (per rank, as in DDP)")
    parser.add_argument("--local-steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--links", type=float, nargs="+", default=[0.0, 1e8],
                        help="link speeds in bits per second (0: loopback)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--overlap-steps", type=int, default=None,
                        help="τ of the overlap arms (default: a fifth of a round)")
    add_start_method_arg(parser)
    args = parser.parse_args()
    args.steps = args.steps or (20 if args.quick else 300)
    if args.quick:
        args.local_steps = min(args.local_steps, 5)
    args.overlap_steps = args.overlap_steps or max(1, args.local_steps // 5)
    name, _ = begin(NAME, args.quick)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for link in args.links:
                for arm in args.arms:  # interleaved: a load change on the machine hits every arm alike
                    if ARMS[arm] is None and link != args.links[0]:
                        continue  # DDP's all-reduce is not behind the emulated link: one run suffices
                    key = f"{arm} @ {link:g}"
                    record = run_arm(arm, seed, link, args, Path(tmp) / f"{arm.replace(' ', '_')}_{link:g}_{seed}")
                    runs.setdefault(key, {"arm": arm, "link": link, "seeds": {}})["seeds"][seed] = record
                    print(f"seed {seed} {key}: {record}", flush=True)
    publish(name, args, {"runs": runs}, table(runs, args), seeds=args.seeds)


def table(runs: dict[str, dict], args: argparse.Namespace) -> str:
    """Medians over seeds would hide too little with one seed: every seed's ratio is shown."""
    def ratios(key: str, ref: str, field: str) -> str:
        if ref not in runs:
            return "—"
        return " / ".join(f"{run[field] / runs[ref]['seeds'][s][field]:.3g}" for s, run in runs[key]["seeds"].items())

    rows = []
    for key, entry in runs.items():
        reference = f"diloco f32 @ {entry['link']:g}" if entry["arm"] != "ddp" else f"diloco f32 @ {args.links[0]:g}"
        seeds = entry["seeds"].values()
        rows.append([entry["arm"], "loopback" if entry["link"] == 0 else f"{entry['link']:.3g} bit/s",
                     " / ".join(fmt(r["loss"]) for r in seeds), ratios(key, reference, "loss"),
                     " / ".join(f"{r['bytes'] / 2**20:.1f}" for r in seeds),
                     ratios(key, f"ddp @ {args.links[0]:g}", "bytes"),
                     " / ".join(f"{r['wall_s']:.0f}" for r in seeds)])
    header = ["arm", "link", "final loss", "÷ DiLoCo f32", "MiB sent", "÷ DDP's bytes", "wall s"]
    return (markdown_table(header, rows) + f"\n\n{args.workload}, W = {args.workers}, {args.steps} steps per rank, "
            f"H = {args.local_steps}, lr {args.lr}, batch {args.batch_size} per rank, overlap τ = "
            f"{getattr(args, 'overlap_steps', None)}")  # why getattr: hand-made arguments (tests) may omit it


if __name__ == "__main__":
    main()
