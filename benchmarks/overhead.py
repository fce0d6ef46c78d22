"""Benchmark 4, overhead: HDET's step throughput relative to DDP, bytes communicated per inner step, and
the async server's host memory.

- **Throughput**: ``"ddp"`` and HDET (one member per rank, published fan-out, gradients averaged over all
  ranks, a vote and merge every ``T`` = 50 / 100 / 1000 steps) on the same ``W`` processes and model,
  measured side by side in one invocation (arms interleaved over ``--repeats``): rank 0's training
  steps per second from its first to its last training step (start-up and validation excluded).
- **Bytes per inner step**, per worker: computed from the parameter count ``P``, the codec and the exchange
  pattern, and measured by counting the bytes each rank hands to ``torch.distributed``'s Python
  ``send``/``recv``/``all_reduce`` (DDP's gradient buckets go through PyTorch's default all-reduce hook,
  as HDET's go through its own hook, so both arms pay a Python hook per bucket). DDP all-reduces ``4P`` bytes per step (a ring
  all-reduce puts ``2(W-1)/W × 4P`` on each rank's wire); HDET adds one ``4P`` all-reduce per ``T``
  steps; DiLoCo and async send the encoded pseudo-gradient (``4P`` uncompressed, ``2P`` in bf16, ``P`` plus
  one float32 scale per row in int8) and receive ``4P`` (global parameters) per round of ``H`` inner steps,
  against the bound of two float32 models per round, ``8P / H``. By default nothing else travels (each worker
  checkpoints its own inner optimizer state); the row "inner states" sets ``checkpoint_inner_states=True``,
  which also sends AdamW's state (``8P``) with every push and with the last message.
- **Host memory**: rank 0's peak resident set (``ru_maxrss``) under async DN + DyLU and under DiLoCo minus
  under DDP, at two model widths, relative to the model's float32 size, and its slope (extra memory per unit
  of model between the two widths: what grows with the model, without the fixed costs). Rank 0 both trains
  and runs the outer optimizer, which keeps the global parameters and the momentum (and the DN buffer, or
  DiLoCo's round sum: 3 × model) and one fragment (at most 25 MiB) of a push in flight; its worker keeps
  the pulled model (1 ×); DDP keeps gradient buckets (1 × model) instead.

Run: ``python benchmarks/overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RunSpec, add_output_args, begin, fit_run, fmt, markdown_table, publish

NAME = "overhead"
_COUNTS = {"collective": 0, "sent": 0, "received": 0}


def _counting(fn: Any, key: str, arg: int = 0) -> Any:
    """Wrap ``fn`` to add the size of its ``arg``-th argument (the tensor this rank hands over) to ``key``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tensor = args[arg]
        _COUNTS[key] += tensor.numel() * tensor.element_size()
        return fn(*args, **kwargs)

    return wrapper


class Probe(Callback):
    """In each rank: count the payload bytes passed to ``torch.distributed`` (send, recv, all_reduce, this
    rank's input to all_gather) and,
    at the end of the fit, write ``probe{rank}.json`` with the counts, the training steps and their span
    in seconds (first to last training step) and the peak resident memory. ``count_ddp_buckets`` routes DDP's
    gradient buckets through PyTorch's default all-reduce hook, i.e. through the counted Python
    ``all_reduce`` (Lightning registers communication hooks only on CUDA)."""

    def __init__(self, out_dir: Path, count_ddp_buckets: bool = False) -> None:
        self.out_dir = out_dir
        self.count_ddp_buckets = count_ddp_buckets

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if not getattr(dist, "_bench_patched", False):
            dist.send = _counting(dist.send, "sent")
            dist.recv = _counting(dist.recv, "received")
            dist.all_reduce = _counting(dist.all_reduce, "collective")
            # (output list, input tensor); all_gather_object calls it through distributed_c10d's own name
            dist.all_gather = c10d.all_gather = _counting(c10d.all_gather, "collective", arg=1)
            dist._bench_patched = True
        _COUNTS.update(dict.fromkeys(_COUNTS, 0))
        self.times: list[float] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.count_ddp_buckets:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_hdet.asynchronous.messages import Fragments

        compression = getattr(trainer.strategy, "compression", "none")
        record = {
            # what one encoded push of the parameters weighs (the codec's bytes), and the float buffers' values
            "encoded_push_bytes": Fragments([p.shape for p in pl_module.parameters()], compression).nbytes,
            "float_buffer_values": sum(b.numel() for b in pl_module.buffers() if b.is_floating_point()),
            **_COUNTS,
            "steps": len(self.times),
            "span_s": self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "params": sum(p.numel() for p in pl_module.parameters()),
        }
        (self.out_dir / f"probe{trainer.global_rank}.json").write_text(json.dumps(record))


def run_probe(
    kind: str, args: argparse.Namespace, work: Path, steps: int, d_model: int, every: int = 0,
    inner_states: bool = False, compression: str = "none",
) -> list[dict]:
    """One fit of ``kind`` (``ddp``, ``hdet``, ``diloco``, ``async``); returns every rank's probe record.
    ``inner_states`` and ``compression`` are the async strategy's ``checkpoint_inner_states`` and ``compression``."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import AsyncLocalSGDStrategy, HDETCallback, HDETStrategy

    common = {"start_method": "spawn", "process_group_backend": "gloo"}
    callbacks: list[Callback] = [Probe(work, count_ddp_buckets=kind == "ddp")]
    if kind == "ddp":
        strategy = DDPStrategy(**common)
    elif kind == "hdet":
        strategy = HDETStrategy(**common)
        callbacks.append(HDETCallback(every_n_steps=every))
    else:
        mode = "sync" if kind == "diloco" else "async"
        strategy = AsyncLocalSGDStrategy(local_steps=args.local_steps, mode=mode, checkpoint_inner_states=inner_states,
                                         compression=compression, **common)
    spec = RunSpec(
        lr=1e-2, steps=steps, devices=args.world_size, batch_size=args.batch_size, max_chars=args.max_chars,
        val_every=steps, val_batches=1, model={"d_model": d_model, "n_layers": args.n_layers},
    )
    work.mkdir(parents=True, exist_ok=True)
    fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    return [json.loads((work / f"probe{r}.json").read_text()) for r in range(args.world_size)]


def computed_bytes(kind: str, probe: dict, every: int, local_steps: int, steps: int, inner_states: bool) -> float:
    """Payload bytes one worker hands to the network per inner step, from the exchange pattern: for DiLoCo/async
    a run of ``steps`` inner steps in rounds of ``local_steps``, each round one push (the encoded pseudo-gradient,
    ``probe["encoded_push_bytes"]``, and the float buffers' values) and one pull (the float32 parameters and
    buffers), with AdamW as the inner optimizer (a worker that dynamic local steps gives shorter rounds
    exchanges more often than this)."""
    model = 4 * probe["params"]
    if kind == "ddp":
        return model
    if kind == "hdet":
        return model + model / every
    buffers = 4 * probe["float_buffer_values"]
    exchange = (probe["encoded_push_bytes"] + buffers + model + buffers) / local_steps
    # AdamW's two moments with every push and with the last message (on a fresh run the first message's state is
    # still empty); by default they never travel.
    return exchange + (2 * model * (1 / local_steps + 1 / steps) if inner_states else 0.0)


def bound_bytes(params: int, local_steps: int) -> float:
    """Two float32 models per round of ``local_steps`` inner steps: the uncompressed push and pull alone."""
    return 2 * 4 * params / local_steps


def measured_bytes(probes: list[dict]) -> float:
    """Measured payload bytes per inner step of worker 1 (not the server's rank)."""
    p = probes[1]
    return (p["collective"] + p["sent"] + p["received"]) / p["steps"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_output_args(p)
    p.add_argument("--world-size", type=int, default=2, help="W processes")
    p.add_argument("--steps", type=int, default=None, help="throughput steps per arm (default 300, quick 16)")
    p.add_argument("--intervals", type=int, nargs="+", default=None, help="HDET T values (default 50 100 1000; quick 4 8)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repetitions of the throughput arms (median)")
    p.add_argument("--local-steps", type=int, default=None, help="H for DiLoCo/async (default 20, quick 2)")
    p.add_argument("--exchange-steps", type=int, default=None, help="budget S of the DiLoCo/async runs (default 100, quick 8)")
    p.add_argument("--d-model", type=int, default=None, help="throughput model width (default 64, quick 32)")
    p.add_argument("--memory-d-models", type=int, nargs=2, default=None,
                   help="the two widths of the memory runs; the first also for the bytes runs (default 256 512, quick 32 64)")
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None, help="per process (default 16, quick 8)")
    p.add_argument("--max-chars", type=int, default=1_000_000)
    args = p.parse_args(argv)
    q = args.quick
    args.steps = args.steps or (16 if q else 300)
    args.intervals = args.intervals or ([4, 8] if q else [50, 100, 1000])
    args.local_steps = args.local_steps or (2 if q else 20)
    args.exchange_steps = args.exchange_steps or (8 if q else 100)
    args.d_model = args.d_model or (32 if q else 64)
    args.memory_d_models = args.memory_d_models or ([32, 64] if q else [256, 512])
    args.batch_size = args.batch_size or (8 if q else 16)
    if args.world_size < 2:
        p.error(f"--world-size={args.world_size} must be at least 2")
    return args


#: The DiLoCo/async rows of the bytes table: (label suffix, kind, checkpoint_inner_states, compression).
BYTES_ARMS = [("", "diloco", False, "none"), ("", "async", False, "none"), (", inner states", "diloco", True, "none"),
              (", bf16", "diloco", False, "bf16"), (", int8", "diloco", False, "int8")]
MEMORY_KINDS = ("ddp", "diloco", "async")


def run_all(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """Every fit: the throughput arms (interleaved repeats), the bytes rows and the memory runs at both widths."""
    speed: dict[str, list[float]] = {}
    probes: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for kind, every in [("ddp", 0)] + [("hdet", t) for t in args.intervals]:
            label = kind if kind == "ddp" else f"hdet T={every}"
            ranks = run_probe(kind, args, tmp / f"{label}_{rep}".replace(" ", "_"), args.steps, args.d_model, every)
            speed.setdefault(label, []).append((ranks[0]["steps"] - 1) / ranks[0]["span_s"])
            probes[label] = ranks
    for width in args.memory_d_models:
        for kind in MEMORY_KINDS:
            probes[f"{kind} (memory {width})"] = run_probe(kind, args, tmp / f"mem_{kind}_{width}", args.exchange_steps, width)
    width = args.memory_d_models[0]
    for suffix, kind, inner, compression in BYTES_ARMS:
        label = f"{kind} H={args.local_steps}{suffix}"
        probes[label] = (probes[f"{kind} (memory {width})"] if not suffix else run_probe(
            kind, args, tmp / label.replace(" ", "_").replace(",", ""), args.exchange_steps, width, 0, inner, compression))
    return speed, probes


def tables(args: argparse.Namespace, speed: dict[str, list[float]], probes: dict[str, list[dict]]) -> dict:
    """The three tables' rows from the runs."""
    ddp_speed = statistics.median(speed["ddp"])
    throughput = [
        {"arm": label, "steps_per_s": statistics.median(v), "relative_to_ddp": statistics.median(v) / ddp_speed}
        for label, v in speed.items()
    ]
    h, comm = args.local_steps, []
    arms = [("ddp", "ddp", 0, False), *[(f"hdet T={t}", "hdet", t, False) for t in args.intervals],
            *[(f"{kind} H={h}{suffix}", kind, 0, inner) for suffix, kind, inner, _ in BYTES_ARMS]]
    for label, kind, every, inner in arms:
        ranks = probes[label]
        params = ranks[0]["params"]
        row = {"arm": label, "params": params,
               "computed_bytes_per_step": computed_bytes(kind, ranks[0], every, h, args.exchange_steps, inner),
               "measured_bytes_per_step": measured_bytes(ranks)}
        if kind in ("diloco", "async"):
            row["measured_over_bound"] = row["measured_bytes_per_step"] / bound_bytes(params, h)
        comm.append(row)
    memory = []
    for width in args.memory_d_models:
        rss = {k: probes[f"{k} (memory {width})"][0]["peak_rss_bytes"] for k in MEMORY_KINDS}
        model_bytes = 4 * probes[f"ddp (memory {width})"][0]["params"]
        memory.append({"width": width, "model_bytes": model_bytes, "rank0_peak_rss_bytes": rss,
                       **{f"{k}_minus_ddp_over_model": (rss[k] - rss["ddp"]) / model_bytes for k in ("diloco", "async")}})
    small, large = memory
    slope = {k: ((large["rank0_peak_rss_bytes"][k] - large["rank0_peak_rss_bytes"]["ddp"])
                 - (small["rank0_peak_rss_bytes"][k] - small["rank0_peak_rss_bytes"]["ddp"]))
             / (large["model_bytes"] - small["model_bytes"]) for k in ("diloco", "async")}
    return {"throughput": throughput, "bytes": comm, "memory": memory, "memory_slope": slope}


def markdown(args: argparse.Namespace, result: dict, total_s: float) -> str:
    mb = 2**20
    memory_rows = [[str(m["width"]), fmt(m["model_bytes"] / mb, ".2f"),
                    *(fmt(m["rank0_peak_rss_bytes"][k] / mb, ".1f") for k in MEMORY_KINDS),
                    fmt(m["async_minus_ddp_over_model"], ".1f"), fmt(m["diloco_minus_ddp_over_model"], ".1f")]
                   for m in result["memory"]]
    slope = result["memory_slope"]
    memory_rows.append(["slope (per unit of model)", "", "", "", "", fmt(slope["async"], ".1f"), fmt(slope["diloco"], ".1f")])
    widths = " and ".join(str(w) for w in args.memory_d_models)
    return (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes; throughput: width "
        f"{args.d_model}, {args.steps} steps per arm, {args.repeats} interleaved repeat(s), median; bytes: width "
        f"{args.memory_d_models[0]}, memory: widths {widths}; budget {args.exchange_steps} steps, "
        f"H = {args.local_steps}. Total wall-clock {total_s:.0f} s.\n\n"
        + markdown_table(["arm", "steps/s (rank 0)", "relative to ddp"],
                         [[r["arm"], fmt(r["steps_per_s"], ".2f"), fmt(r["relative_to_ddp"], ".3f")]
                          for r in result["throughput"]])
        + "\n\n"
        + markdown_table(["arm", "parameters", "bytes/inner step, computed", "bytes/inner step, measured (worker 1)",
                          "measured / (2 models / H)"],
                         [[r["arm"], str(r["params"]), fmt(r["computed_bytes_per_step"], ".0f"),
                           fmt(r["measured_bytes_per_step"], ".0f"),
                           fmt(r["measured_over_bound"], ".3f") if "measured_over_bound" in r else ""]
                          for r in result["bytes"]])
        + "\n\n"
        + markdown_table(["width", "model (float32, MB)", "rank 0 peak RSS ddp (MB)", "diloco (MB)", "async DN+DyLU (MB)",
                          "(async − ddp) / model", "(diloco − ddp) / model"], memory_rows)
        + "\n"
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(NAME, args.quick)
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        speed, probes = run_all(args, Path(tmp))
    total_s = time.perf_counter() - t0
    result = tables(args, speed, probes)
    payload = {"total_wall_s": total_s, **result, "raw_speed": speed}
    publish(name, args, payload, markdown(args, result, total_s), args.max_chars)
    return payload


if __name__ == "__main__":
    main()
