"""Benchmark 4, overhead: HDET's step throughput relative to DDP, bytes communicated per inner step, and
the async server's host memory.

- **Throughput**: ``"ddp"`` and HDET (one member per rank, published fan-out, gradients averaged over all
  ranks, a vote and merge every ``T`` = 50 / 100 / 1000 steps) on the same ``W`` processes and model,
  measured side by side in one invocation (arms interleaved over ``--repeats``): rank 0's training
  steps per second from its first to its last training step (start-up and validation excluded).
- **Bytes per inner step**, per worker, float32 payload: computed from the parameter count ``P`` and the
  exchange pattern, and measured by counting the bytes each rank hands to ``torch.distributed``'s Python
  ``send``/``recv``/``all_reduce`` (DDP's gradient buckets go through PyTorch's default all-reduce hook,
  as HDET's go through its own hook, so both arms pay a Python hook per bucket). DDP all-reduces ``4P`` bytes per step (a ring
  all-reduce puts ``2(W-1)/W × 4P`` on each rank's wire); HDET adds one ``4P`` all-reduce per ``T``
  steps; DiLoCo and async send ``4P`` (pseudo-gradient) and receive ``4P`` (global parameters) per
  round of ``H`` inner steps, and by default (``checkpoint_inner_states=True``) also send their inner
  optimizer state (AdamW: ``8P``) with every push and with their last message; the row
  "diloco ..., no inner states" turns that off (the states are then gathered once, at the end of ``fit``).
- **Host memory**: rank 0's peak resident set (``ru_maxrss``) under async DN + DyLU minus under DDP on a
  larger model, relative to the model's float32 size. Rank 0 both trains and runs the outer optimizer,
  which keeps the global parameters, the Nesterov momentum and the Delayed-Nesterov buffer (3 × model),
  one receive buffer per push and each worker's latest inner optimizer state (AdamW: 2 × model per
  worker); DDP keeps gradient buckets (1 × model) instead.

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
        record = {
            **_COUNTS,
            "steps": len(self.times),
            "span_s": self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "params": sum(p.numel() for p in pl_module.parameters()),
        }
        (self.out_dir / f"probe{trainer.global_rank}.json").write_text(json.dumps(record))


def run_probe(
    kind: str, args: argparse.Namespace, work: Path, steps: int, d_model: int, every: int = 0, inner_states: bool = True
) -> list[dict]:
    """One fit of ``kind`` (``ddp``, ``hdet``, ``diloco``, ``async``); returns every rank's probe record.
    ``inner_states`` is the async strategy's ``checkpoint_inner_states``."""
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
        strategy = AsyncLocalSGDStrategy(local_steps=args.local_steps, mode=mode,
                                         checkpoint_inner_states=inner_states, **common)
    spec = RunSpec(
        lr=1e-2, steps=steps, devices=args.world_size, batch_size=args.batch_size, max_chars=args.max_chars,
        val_every=steps, val_batches=1, model={"d_model": d_model, "n_layers": args.n_layers},
    )
    work.mkdir(parents=True, exist_ok=True)
    fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    return [json.loads((work / f"probe{r}.json").read_text()) for r in range(args.world_size)]


def computed_bytes(kind: str, params: int, every: int, local_steps: int, steps: int, inner_states: bool) -> float:
    """Payload bytes one worker hands to the network per inner step, from the exchange pattern: for DiLoCo/async
    a run of ``steps`` inner steps in rounds of ``local_steps`` with AdamW as the inner optimizer (a worker
    that dynamic local steps gives shorter rounds exchanges more often than this)."""
    model = 4 * params
    if kind == "ddp":
        return model
    if kind == "hdet":
        return model + model / every
    exchange = 2 * model / local_steps  # diloco / async: push the pseudo-gradient, pull the parameters
    # AdamW's two moments: with every push and with the last message (on a fresh run the first message's state
    # is still empty), or, without inner states, gathered once at the end of fit.
    return exchange + 2 * model * ((1 / local_steps + 1 / steps) if inner_states else 1 / steps)


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
    p.add_argument("--memory-d-model", type=int, default=None, help="width for the bytes/memory runs (default 256, quick 32)")
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
    args.memory_d_model = args.memory_d_model or (32 if q else 256)
    args.batch_size = args.batch_size or (8 if q else 16)
    if args.world_size < 2:
        p.error(f"--world-size={args.world_size} must be at least 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(NAME, args.quick)
    arms = [("ddp", 0)] + [("hdet", t) for t in args.intervals]
    speed: dict[str, list[float]] = {}
    probes: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        for rep in range(args.repeats):
            for kind, every in arms:
                label = kind if kind == "ddp" else f"hdet T={every}"
                ranks = run_probe(kind, args, Path(tmp) / f"{label}_{rep}".replace(" ", "_"), args.steps, args.d_model, every)
                speed.setdefault(label, []).append((ranks[0]["steps"] - 1) / ranks[0]["span_s"])
                probes[label] = ranks
        for kind in ("ddp", "diloco", "async"):
            if kind == "ddp" and args.memory_d_model == args.d_model:  # same model: reuse the throughput run
                probes["ddp (memory)"] = probes["ddp"]
                continue
            probes[f"{kind} (memory)"] = run_probe(kind, args, Path(tmp) / f"mem_{kind}", args.exchange_steps, args.memory_d_model)
        probes["diloco (no inner states)"] = run_probe(
            "diloco", args, Path(tmp) / "diloco_no_inner", args.exchange_steps, args.memory_d_model, inner_states=False)
    total_s = time.perf_counter() - t0

    ddp_speed = statistics.median(speed["ddp"])
    throughput = [
        {"arm": label, "steps_per_s": statistics.median(v), "relative_to_ddp": statistics.median(v) / ddp_speed}
        for label, v in speed.items()
    ]
    comm = []
    h = args.local_steps
    for label, arm, kind, every in [
        ("ddp", "ddp", "ddp", 0), *[(f"hdet T={t}", f"hdet T={t}", "hdet", t) for t in args.intervals],
        ("diloco (memory)", f"diloco H={h}", "diloco", 0), ("async (memory)", f"async H={h}", "async", 0),
        ("diloco (no inner states)", f"diloco H={h}, no inner states", "diloco", 0),
    ]:
        ranks = probes[label]
        params = ranks[0]["params"]
        comm.append({
            "arm": arm, "params": params,
            "computed_bytes_per_step": computed_bytes(kind, params, every, h, args.exchange_steps,
                                                      inner_states="no inner states" not in arm),
            "measured_bytes_per_step": measured_bytes(ranks),
        })
    model_bytes = 4 * probes["async (memory)"][0]["params"]
    rss = {k: probes[f"{k} (memory)"][0]["peak_rss_bytes"] for k in ("ddp", "diloco", "async")}
    memory = {
        "model_bytes": model_bytes,
        "rank0_peak_rss_bytes": rss,
        "async_minus_ddp_over_model": (rss["async"] - rss["ddp"]) / model_bytes,
        "diloco_minus_ddp_over_model": (rss["diloco"] - rss["ddp"]) / model_bytes,
    }
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; W = {args.world_size} processes; throughput: width "
        f"{args.d_model}, {args.steps} steps per arm, {args.repeats} interleaved repeat(s), median; bytes and "
        f"memory: width {args.memory_d_model}, budget {args.exchange_steps} steps, H = {args.local_steps}. "
        f"Total wall-clock {total_s:.0f} s.\n\n"
        + markdown_table(["arm", "steps/s (rank 0)", "relative to ddp"],
                         [[r["arm"], fmt(r["steps_per_s"], ".2f"), fmt(r["relative_to_ddp"], ".3f")] for r in throughput])
        + "\n\n"
        + markdown_table(["arm", "parameters", "bytes/inner step, computed", "bytes/inner step, measured (worker 1)"],
                         [[r["arm"], str(r["params"]), fmt(r["computed_bytes_per_step"], ".0f"),
                           fmt(r["measured_bytes_per_step"], ".0f")] for r in comm])
        + "\n\n"
        + markdown_table(["rank 0 peak RSS", "ddp", "diloco", "async DN+DyLU", "model (float32)",
                          "(async − ddp) / model", "(diloco − ddp) / model"],
                         [["MB", *(fmt(rss[k] / 2**20, ".1f") for k in ("ddp", "diloco", "async")),
                           fmt(model_bytes / 2**20, ".2f"), fmt(memory["async_minus_ddp_over_model"], ".1f"),
                           fmt(memory["diloco_minus_ddp_over_model"], ".1f")]])
        + "\n"
    )
    payload = {"total_wall_s": total_s, "throughput": throughput, "bytes": comm, "memory": memory,
               "raw_speed": speed}
    publish(name, args, payload, md, args.max_chars)
    return payload


if __name__ == "__main__":
    main()
