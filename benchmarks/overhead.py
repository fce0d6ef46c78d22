"""Benchmark 4, overhead: HDET's step throughput relative to DDP, bytes communicated per inner step, and
the async server's host memory.

- **Throughput**: ``"ddp"`` and HDET (one member per rank, published fan-out, gradients averaged over all
  ranks, a vote and merge every ``T`` = 50 / 100 / 1000 steps) on the same ``W`` processes and model,
  measured side by side in one invocation (arms interleaved over ``--repeats``): rank 0's training
  steps per second from its first to its last training step (start-up and validation excluded), and its CPU
  seconds per step over the same span (the cost of a step, robust to other jobs sharing the machine).
- **Bytes per inner step**, per worker: computed from the parameter count ``P``, the codec and the exchange
  pattern, and measured by counting the bytes each rank hands to ``torch.distributed``'s Python
  ``send``/``recv``/``all_reduce`` (DDP's gradient buckets go through PyTorch's default all-reduce hook,
  as HDET's go through its own hook, so both arms pay a Python hook per bucket). DDP all-reduces ``4P`` bytes per step (a ring
  all-reduce puts ``2(W-1)/W × 4P`` on each rank's wire); HDET adds one ``4P`` all-reduce per ``T``
  steps; DiLoCo and async send the encoded pseudo-gradient (``4P`` uncompressed, ``2P`` in bf16, ``P`` plus
  one float32 scale per row in int8) and receive ``4P`` (global parameters; ``2P`` with
  ``pull_compression="bf16"``) per round of ``H`` inner steps,
  against the bound of two float32 models per round, ``8P / H``. By default nothing else travels (each worker
  checkpoints its own inner optimizer state); the row "inner states" sets ``checkpoint_inner_states=True``,
  which also sends AdamW's state (``8P``) with every push and with the last message.
- **Host memory**: rank 0's peak resident set (``ru_maxrss``) under async DN + DyLU and under DiLoCo minus
  under DDP, at two model widths, relative to the model's float32 size, and its slope (extra memory per unit
  of model between the two widths: what grows with the model, without the fixed costs). Rank 0 both trains
  and runs the outer optimizer, which keeps the global parameters and the momentum (and the DN buffer, or
  DiLoCo's round sum: 3 × model) and one fragment (at most 25 MiB) of a push in flight; its worker keeps
  the pulled model (1 ×); DDP keeps gradient buckets (1 × model) instead.

- **Lean HDET** (``lean``): rank 0's peak resident memory above its level at the call during each HDET merge
  and during a checkpoint, on a wider model (``--lean-d-model``, 4 layers), HDET with one group per rank
  (G = W = 2 and 4) against DDP: a merge should need one 25 MiB bucket, a checkpoint rank 0's own state plus one
  model whatever G is.
- **Sharded** (``sharded``, asked for by name): ``hdet_fsdp`` against Lightning's FSDP2
  (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) and ``hdet`` against DDP, side by side
  in one invocation on ``W`` = 4 processes (HDET: G = 2 groups, a vote every ``T`` steps), arms interleaved over
  ``--repeats``: rank 0's steps/s and CPU time per step (each repeat shown), its peak resident memory while
  training, its peak extra memory during a merge and during a checkpoint (``trainer.save_checkpoint``), and its
  own state. Each fit runs ``benchmarks/sharded_fit.py`` under Lightning's subprocess launcher.

Run: ``python benchmarks/overhead.py [--quick] [--parts throughput exchange memory lean sharded]`` (``memory``: the
host-memory runs of ``exchange`` alone, without its bytes arms, into their own table).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    RunSpec,
    adaptive_rounds,
    add_output_args,
    add_start_method_arg,
    begin,
    fit_run,
    fmt,
    markdown_table,
    publish,
)
from benchmarks.plots import plot_bars

NAME = "overhead"
PARTS = ("throughput", "exchange", "memory", "lean", "sharded")
DEFAULT_PARTS = ("throughput", "exchange", "lean")  # ``sharded`` runs 4 processes per arm: asked for by name
# ``memory`` alone: the host-memory runs of ``exchange`` without its bytes arms (``exchange`` includes them)
# The sharded part's arms and the baseline each is compared with.
SHARDED_BASELINES = {"ddp": "ddp", "hdet": "ddp", "fsdp2": "fsdp2", "hdet_fsdp": "fsdp2"}
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
        self.cpu_times: list[float] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.count_ddp_buckets:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trainer.strategy.model.register_comm_hook(None, default_hooks.allreduce_hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())  # this process's CPU time: robust to other jobs on the machine

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_hdet.asynchronous.wire.messages import Fragments

        layout = Fragments([p.shape for p in pl_module.parameters()], getattr(trainer.strategy, "compression", "none"),
                           pull_compression=getattr(trainer.strategy, "pull_compression", "none"))
        record = {
            # what one encoded push and one pull of the parameters weigh (the codecs' bytes), the float buffers' values
            "encoded_push_bytes": layout.nbytes,
            "encoded_pull_bytes": layout.pull_nbytes,
            "float_buffer_values": sum(b.numel() for b in pl_module.buffers() if b.is_floating_point()),
            **_COUNTS,
            "steps": len(self.times),
            "span_s": self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0,
            "cpu_span_s": self.cpu_times[-1] - self.cpu_times[0] if len(self.cpu_times) > 1 else 0.0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "params": sum(p.numel() for p in pl_module.parameters()),
        }
        (self.out_dir / f"probe{trainer.global_rank}.json").write_text(json.dumps(record))


class PeakRSS:
    """Context manager: ``extra`` is this process's peak resident set above its level at entry, in bytes, sampled
    from ``/proc/self/statm`` every 0.2 ms by a thread (torch's big CPU allocations are ``mmap``s: freed, they
    leave the resident set, so the peak of one call is seen apart from the rest of the run)."""

    def __enter__(self) -> "PeakRSS":
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.0002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.extra = max(self.peak, _rss()) - self.base


class PeakAllocated:
    """Context manager: ``extra`` is the peak of the bytes held by tensors allocated inside it, from torch's
    profiler's allocation and free events (what a GPU's caching allocator would have to hold; unlike the
    resident set, blind to the C library's reuse of freed memory and to the transport's own buffers)."""

    def __enter__(self) -> "PeakAllocated":
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        # an op's own allocations are its ``self`` bytes; frees (and allocations outside ops) are "[memory]" events
        events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in self._profile.events()
                        if e.self_cpu_memory_usage)
        live = self.extra = 0
        for _, change in events:
            live += change
            self.extra = max(self.extra, live)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemoryProbe(Callback):
    """In each rank: the peak extra resident memory of every HDET merge and of one checkpoint written at the end
    of the fit (``trainer.save_checkpoint``); writes ``memory{rank}.json`` with them and the sizes they compare to:
    the model (float32 bytes) and this rank's own state (parameters and optimizer state)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.merges: list[int] = []
        self.merge_tensors: list[int] = []

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        merger = getattr(getattr(trainer.strategy, "hdet", None), "merger", None)
        if merger is None:
            return
        merge = merger.merge

        def measured(*args: Any, **kwargs: Any) -> Any:
            with PeakRSS() as peak, PeakAllocated() as tensors:
                out = merge(*args, **kwargs)
            self.merges.append(peak.extra)
            self.merge_tensors.append(tensors.extra)
            return out

        merger.merge = measured  # the instance's: every merge of the callback goes through it

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_hdet._tensors import to_cpu

        with PeakRSS() as peak:
            trainer.save_checkpoint(self.out_dir / "end.ckpt")
        optimizer_state = to_cpu([opt.state_dict()["state"] for opt in trainer.optimizers])
        record = {
            "merge_extra_bytes": max(self.merges, default=0),
            "merge_tensor_bytes": max(self.merge_tensors, default=0),
            "checkpoint_extra_bytes": peak.extra,
            "model_bytes": 4 * sum(p.numel() for p in pl_module.parameters()),
            "own_state_bytes": _bytes(list(pl_module.state_dict().values())) + _bytes(optimizer_state),
        }
        (self.out_dir / f"memory{trainer.global_rank}.json").write_text(json.dumps(record))


def _bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested structure (of a DTensor: this rank's shard)."""
    if hasattr(obj, "to_local"):
        obj = obj.to_local()
    if hasattr(obj, "element_size"):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(v) for v in obj)
    return 0


def run_memory(kind: str, args: argparse.Namespace, work: Path, world_size: int) -> list[dict]:
    """A short fit of a large char LM (``--lean-d-model``) under ``kind`` (``ddp`` or ``hdet``, one group per
    rank, a merge every 2 steps) on ``world_size`` processes; every rank's :class:`MemoryProbe` record."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import HDETCallback, HDETStrategy

    common = {"start_method": args.start_method, "process_group_backend": "gloo"}
    callbacks: list[Callback] = [MemoryProbe(work)]
    if kind == "ddp":
        strategy = DDPStrategy(**common)
    else:
        strategy = HDETStrategy(spread=1 / 9, gradient_sync="global", **common)  # the overhead tables' set-up
        callbacks.append(HDETCallback(every_n_steps=2, search=False))
    spec = RunSpec(lr=1e-3, steps=4, devices=world_size, batch_size=2, max_chars=args.max_chars, val_every=4,
                   val_batches=1, model={"d_model": args.lean_d_model, "n_layers": 4})
    work.mkdir(parents=True, exist_ok=True)
    fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    return [json.loads((work / f"memory{r}.json").read_text()) for r in range(world_size)]


def run_probe(
    kind: str, args: argparse.Namespace, work: Path, steps: int, d_model: int, every: int = 0,
    inner_states: bool = False, compression: str = "none", pull_compression: str = "none",
) -> list[dict]:
    """One fit of ``kind`` (``ddp``, ``hdet``, ``diloco``, ``async``); returns every rank's probe record, rank 0's
    with the final model's validation loss. ``inner_states``, ``compression`` and ``pull_compression`` are the
    async strategy's ``checkpoint_inner_states``, ``compression`` and ``pull_compression``."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import AsyncLocalSGDStrategy, HDETCallback, HDETStrategy

    common = {"start_method": args.start_method, "process_group_backend": os.environ.get("BENCH_BACKEND", "gloo")}
    callbacks: list[Callback] = [Probe(work, count_ddp_buckets=kind == "ddp")]
    if kind == "ddp":
        strategy = DDPStrategy(**common)
    elif kind == "hdet":
        strategy = HDETStrategy(spread=1 / 9, gradient_sync="global", **common)  # the overhead tables' set-up
        callbacks.append(HDETCallback(every_n_steps=every, search=False))
    else:
        mode = "sync" if kind == "diloco" else "async"
        strategy = AsyncLocalSGDStrategy(local_steps=adaptive_rounds(args.local_steps, mode), mode=mode,
                                         checkpoint_inner_states=inner_states,
                                         compression=compression, pull_compression=pull_compression, **common)
    spec = RunSpec(
        lr=1e-2, steps=steps, devices=args.world_size, batch_size=args.batch_size, max_chars=args.max_chars,
        val_every=steps, val_batches=4, model={"d_model": d_model, "n_layers": args.n_layers},
    )
    work.mkdir(parents=True, exist_ok=True)
    run = fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    records = [json.loads((work / f"probe{r}.json").read_text()) for r in range(args.world_size)]
    records[0]["final_val_loss"] = run.final_model_val_loss
    return records


def computed_bytes(kind: str, probe: dict, every: int, local_steps: int, steps: int, inner_states: bool) -> float:
    """Payload bytes one worker hands to the network per inner step, from the exchange pattern: for DiLoCo/async
    a run of ``steps`` inner steps in rounds of ``local_steps``, each round one push (the encoded pseudo-gradient,
    ``probe["encoded_push_bytes"]``, and the float buffers' values) and one pull (the encoded parameters,
    ``probe["encoded_pull_bytes"]``, and the float32 buffers), with AdamW as the inner optimizer (a worker that
    dynamic local steps gives shorter rounds exchanges more often than this)."""
    model = 4 * probe["params"]
    if kind == "ddp":
        return model
    if kind == "hdet":
        return model + model / every
    buffers = 4 * probe["float_buffer_values"]
    exchange = (probe["encoded_push_bytes"] + buffers + probe["encoded_pull_bytes"] + buffers) / local_steps
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
    add_start_method_arg(p)
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
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS),
                   help="throughput (with the bytes of ddp/hdet), exchange (diloco/async bytes and host memory), "
                        "memory (exchange's host-memory runs alone), lean (HDET merge and checkpoint memory), "
                        "sharded (hdet_fsdp vs FSDP2 and hdet vs DDP on --sharded-world-size processes; not in the "
                        "default); results of a subset other than the default go to overhead_<parts>")
    p.add_argument("--lean-d-model", type=int, default=None,
                   help="width of the lean memory runs (default 768, quick 64)")
    p.add_argument("--lean-world-sizes", type=int, nargs="+", default=None,
                   help="G = W of the merge/checkpoint memory runs (default 2 4, quick 2)")
    p.add_argument("--sharded-world-size", type=int, default=4, help="W of the sharded part (default 4)")
    p.add_argument("--sharded-groups", type=int, default=2, help="G of hdet and hdet_fsdp in the sharded part")
    p.add_argument("--sharded-d-model", type=int, default=None, help="width, 4 layers (default 256, quick 64)")
    p.add_argument("--sharded-steps", type=int, default=None, help="steps per sharded arm (default 200, quick 24)")
    p.add_argument("--sharded-every", type=int, default=None, help="T of the sharded part (default 100, quick 8)")
    args = p.parse_args(argv)
    q = args.quick
    args.steps = args.steps or (16 if q else 300)
    args.intervals = args.intervals or ([4, 8] if q else [50, 100, 1000])
    args.local_steps = args.local_steps or (2 if q else 20)
    args.exchange_steps = args.exchange_steps or (8 if q else 100)
    args.d_model = args.d_model or (32 if q else 64)
    args.memory_d_models = args.memory_d_models or ([32, 64] if q else [256, 512])
    args.batch_size = args.batch_size or (8 if q else 16)
    args.lean_d_model = args.lean_d_model or (64 if q else 768)
    args.lean_world_sizes = args.lean_world_sizes or ([2] if q else [2, 4])
    args.sharded_d_model = args.sharded_d_model or (64 if q else 256)
    args.sharded_steps = args.sharded_steps or (24 if q else 200)
    args.sharded_every = args.sharded_every or (8 if q else 100)
    if args.world_size < 2:
        p.error(f"--world-size={args.world_size} must be at least 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    parts = [part for part in PARTS if part in args.parts]
    name, t0 = begin(NAME if parts == list(DEFAULT_PARTS) else "_".join([NAME, *parts]), args.quick)
    load = os.getloadavg()[0]
    payload: dict[str, Any] = {}
    sections: list[str] = []
    with tempfile.TemporaryDirectory(prefix=name) as tmp:
        probes: dict[str, list[dict]] = {}
        if "throughput" in parts:
            speed = measure_throughput(args, Path(tmp), probes)
            payload.update(throughput=speed["rows"], raw_speed=speed["raw"], raw_cpu_s_per_step=speed["raw_cpu"])
            sections.append(markdown_table(
                ["arm", "steps/s (rank 0)", "relative to ddp", "repeats", "CPU ms/step (rank 0)",
                 "ddp's CPU time / arm's", "repeats (CPU ms/step)"],
                [[r["arm"], fmt(r["steps_per_s"], ".2f"), fmt(r["relative_to_ddp"], ".3f"),
                  " / ".join(fmt(x, ".2f") for x in payload["raw_speed"][r["arm"]]), fmt(r["cpu_ms_per_step"], ".1f"),
                  fmt(r["cpu_relative_to_ddp"], ".3f"),
                  " / ".join(fmt(1000 * x, ".1f") for x in payload["raw_cpu_s_per_step"][r["arm"]])]
                 for r in payload["throughput"]]))
        if "exchange" in parts or "memory" in parts:
            measure = measure_exchange if "exchange" in parts else measure_memory
            exchange, table = measure(args, Path(tmp), probes)
            payload.update(exchange)
            sections.append(table)
        rows = bytes_rows(args, probes)
        if rows:
            payload["bytes"] = rows
            sections.insert(1 if "throughput" in parts else 0, bytes_table(payload["bytes"]))
        if "lean" in parts:
            payload["lean"], table = measure_lean(args, Path(tmp))
            sections.append(table)
        if "sharded" in parts:
            payload["sharded"], table = measure_sharded(args, Path(tmp))
            sections.append(table)
    payload["total_wall_s"] = time.perf_counter() - t0
    settings = {
        "throughput": f"throughput: W = {args.world_size}, width {args.d_model}, {args.steps} steps per arm, "
                      f"{args.repeats} interleaved repeat(s), median",
        "exchange": f"bytes: width {args.memory_d_models[0]}, memory: widths "
                    f"{' and '.join(str(w) for w in args.memory_d_models)}; W = {args.world_size}, budget "
                    f"{args.exchange_steps} steps, H = {args.local_steps}",
        "memory": f"memory: widths {' and '.join(str(w) for w in args.memory_d_models)}; W = {args.world_size}, "
                  f"budget {args.exchange_steps} steps, H = {args.local_steps}, batch {args.batch_size}",
        "lean": f"lean: width {args.lean_d_model}, 4 layers",
        "sharded": f"sharded: W = {args.sharded_world_size}, G = {args.sharded_groups}, width {args.sharded_d_model}, "
                   f"4 layers, {args.sharded_steps} steps per arm, T = {args.sharded_every}, {args.repeats} "
                   "interleaved repeat(s), median",
    }
    md = (
        f"Mode: {'quick' if args.quick else 'full'}; parts: {', '.join(parts)}; "
        + "; ".join(settings[part] for part in parts)
        + f". Load average at the start {load:.1f} on {os.cpu_count()} cores. Total wall-clock "
        f"{payload['total_wall_s']:.0f} s.\n\n"
        + "\n\n".join(sections) + "\n"
    )
    if "throughput" in parts:
        plot = plot_bars(args.docs_dir / "img" / f"{name}.png",
                         {"CPU ms per step (rank 0)": {r["arm"]: r["cpu_ms_per_step"] for r in payload["throughput"]},
                          "steps/s relative to ddp": {r["arm"]: r["relative_to_ddp"] for r in payload["throughput"]}},
                         f"HDET against DDP, W = {args.world_size} (median of {args.repeats} repeats)")
        md += f"\n![{name}](img/{plot.name})\n"
    publish(name, args, payload, md, args.max_chars)
    return payload


def measure_throughput(args: argparse.Namespace, tmp: Path, probes: dict[str, list[dict]]) -> dict:
    """DDP and HDET at every T, interleaved over the repeats; rows with the median, and ``raw`` per arm."""
    arms = [("ddp", 0)] + [("hdet", t) for t in args.intervals]
    speed: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # rank 0's CPU seconds per step: what a step costs, whatever else runs
    for rep in range(args.repeats):
        for kind, every in arms:
            label = kind if kind == "ddp" else f"hdet T={every}"
            ranks = run_probe(kind, args, tmp / f"{label}_{rep}".replace(" ", "_"), args.steps, args.d_model, every)
            speed.setdefault(label, []).append((ranks[0]["steps"] - 1) / ranks[0]["span_s"])
            cpu.setdefault(label, []).append(ranks[0]["cpu_span_s"] / (ranks[0]["steps"] - 1))
            probes[label] = ranks
    ddp_speed, ddp_cpu = statistics.median(speed["ddp"]), statistics.median(cpu["ddp"])
    return {"rows": [
        {"arm": label, "steps_per_s": statistics.median(v), "relative_to_ddp": statistics.median(v) / ddp_speed,
         "cpu_ms_per_step": 1000 * statistics.median(cpu[label]),
         "cpu_relative_to_ddp": ddp_cpu / statistics.median(cpu[label])}
        for label, v in speed.items()
    ], "raw": speed, "raw_cpu": cpu}


#: The DiLoCo/async rows of the bytes table: (label suffix, kind, checkpoint_inner_states, compression,
#: pull_compression).
BYTES_ARMS = [("", "diloco", False, "none", "none"), ("", "async", False, "none", "none"),
              (", inner states", "diloco", True, "none", "none"), (", bf16", "diloco", False, "bf16", "none"),
              (", bf16 push and pull", "diloco", False, "bf16", "bf16"), (", int8", "diloco", False, "int8", "none"),
              (", int8 push, bf16 pull", "diloco", False, "int8", "bf16")]
MEMORY_KINDS = ("ddp", "diloco", "async")


def measure_exchange(args: argparse.Namespace, tmp: Path, probes: dict[str, list[dict]]) -> tuple[dict, str]:
    """:func:`measure_memory`, and the DiLoCo/async bytes rows (the first width's runs, plus inner states, bf16
    and int8)."""
    memory_part = measure_memory(args, tmp, probes)
    width = args.memory_d_models[0]
    for suffix, kind, inner, compression, pull in BYTES_ARMS:
        label = f"{kind} H={args.local_steps}{suffix}"
        probes[label] = (probes[f"{kind} (memory {width})"] if not suffix else run_probe(
            kind, args, tmp / label.replace(" ", "_").replace(",", ""), args.exchange_steps, width, 0, inner,
            compression, pull))
    return memory_part


def measure_memory(args: argparse.Namespace, tmp: Path, probes: dict[str, list[dict]]) -> tuple[dict, str]:
    """DDP, DiLoCo and async at both memory widths: rank 0's peak host memory and its slope per unit of model."""
    for width in args.memory_d_models:
        for kind in MEMORY_KINDS:
            probes[f"{kind} (memory {width})"] = run_probe(kind, args, tmp / f"mem_{kind}_{width}", args.exchange_steps, width)
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
    mb = 2**20
    rows = [[str(m["width"]), fmt(m["model_bytes"] / mb, ".2f"),
             *(fmt(m["rank0_peak_rss_bytes"][k] / mb, ".1f") for k in MEMORY_KINDS),
             fmt(m["async_minus_ddp_over_model"], ".1f"), fmt(m["diloco_minus_ddp_over_model"], ".1f")]
            for m in memory]
    rows.append(["slope (per unit of model)", "", "", "", "", fmt(slope["async"], ".1f"), fmt(slope["diloco"], ".1f")])
    table = markdown_table(["width", "model (float32, MB)", "rank 0 peak RSS ddp (MB)", "diloco (MB)",
                            "async DN+DyLU (MB)", "(async − ddp) / model", "(diloco − ddp) / model"], rows)
    return {"memory": memory, "memory_slope": slope}, table


def bytes_rows(args: argparse.Namespace, probes: dict[str, list[dict]]) -> list[dict]:
    """Computed and measured bytes per inner step of every arm that ran."""
    h = args.local_steps
    rows = []
    for label, kind, every, inner in [
        ("ddp", "ddp", 0, False), *[(f"hdet T={t}", "hdet", t, False) for t in args.intervals],
        *[(f"{kind} H={h}{suffix}", kind, 0, inner) for suffix, kind, inner, _, _ in BYTES_ARMS],
    ]:
        if label not in probes:
            continue
        ranks = probes[label]
        params = ranks[0]["params"]
        row = {"arm": label, "params": params,
               "computed_bytes_per_step": computed_bytes(kind, ranks[0], every, h, args.exchange_steps, inner),
               "measured_bytes_per_step": measured_bytes(ranks)}
        if kind in ("diloco", "async"):
            row["measured_over_bound"] = row["measured_bytes_per_step"] / bound_bytes(params, h)
            row["final_val_loss"] = ranks[0]["final_val_loss"]
            plain = probes.get(f"{kind} H={h}")  # the same mode uncompressed, same seed and data
            if plain is not None:
                row["loss_change"] = row["final_val_loss"] / plain[0]["final_val_loss"] - 1
        rows.append(row)
    return rows


def bytes_table(rows: list[dict]) -> str:
    """The bytes table of :func:`bytes_rows`: computed and measured bytes per inner step, against the bound, and
    the final loss of each DiLoCo/async arm against the same mode uncompressed."""
    return markdown_table(
        ["arm", "parameters", "bytes/inner step, computed", "bytes/inner step, measured (worker 1)",
         "measured / (2 models / H)", "final val loss", "change vs uncompressed"],
        [[r["arm"], str(r["params"]), fmt(r["computed_bytes_per_step"], ".0f"), fmt(r["measured_bytes_per_step"], ".0f"),
          fmt(r["measured_over_bound"], ".3f") if "measured_over_bound" in r else "",
          fmt(r.get("final_val_loss"), ".4f"),
          fmt(100 * r["loss_change"], "+.2f") + " %" if "loss_change" in r else ""]
         for r in rows])


def measure_lean(args: argparse.Namespace, tmp: Path) -> tuple[list[dict], str]:
    """Rank 0's peak extra memory during a merge and during a checkpoint, HDET (G = W) against DDP."""
    rows = []
    for world_size in args.lean_world_sizes:
        for kind in ("ddp", "hdet"):
            rank0 = run_memory(kind, args, tmp / f"lean_{kind}_{world_size}", world_size)[0]
            rows.append({"arm": kind, "world_size": world_size, **rank0})
    mb = lambda x: fmt(x / 2**20, ".1f")  # noqa: E731
    table = markdown_table(
        ["arm", "W (= G for hdet)", "model MB", "rank 0 own state MB", "merge: peak extra MB",
         "merge: peak tensors MB", "checkpoint: peak extra MB", "checkpoint extra / (own state + model)"],
        [[r["arm"], str(r["world_size"]), mb(r["model_bytes"]), mb(r["own_state_bytes"]),
          mb(r["merge_extra_bytes"]) if r["arm"] == "hdet" else "—",
          mb(r["merge_tensor_bytes"]) if r["arm"] == "hdet" else "—", mb(r["checkpoint_extra_bytes"]),
          fmt(r["checkpoint_extra_bytes"] / (r["own_state_bytes"] + r["model_bytes"]), ".2f")] for r in rows])
    return rows, table



def run_sharded(arm: str, args: argparse.Namespace, work: Path) -> dict:
    """One fit of the sharded part (``benchmarks/sharded_fit.py`` under Lightning's subprocess launcher); rank 0's
    :class:`Probe` and :class:`MemoryProbe` records, merged."""
    settings = {"world_size": args.sharded_world_size, "groups": args.sharded_groups, "every": args.sharded_every,
                "steps": args.sharded_steps, "batch_size": args.batch_size, "max_chars": args.max_chars,
                "d_model": args.sharded_d_model}
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    script = Path(__file__).with_name("sharded_fit.py")
    proc = subprocess.run([sys.executable, str(script), arm, str(work), json.dumps(settings)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"sharded arm {arm!r} failed:\n{proc.stderr[-4000:]}")
    return {**json.loads((work / "probe0.json").read_text()), **json.loads((work / "memory0.json").read_text())}


def measure_sharded(args: argparse.Namespace, tmp: Path) -> tuple[list[dict], str]:
    """``hdet_fsdp`` against FSDP2 and ``hdet`` against DDP in one run, arms interleaved over the repeats: rank 0's
    steps/s and CPU time per step, its peak resident memory while training, its peak extra memory during a merge
    and during a checkpoint, and its own state (parameters and optimizer state it holds)."""
    runs: dict[str, list[dict]] = {arm: [] for arm in SHARDED_BASELINES}
    for rep in range(args.repeats):
        for arm in SHARDED_BASELINES:
            runs[arm].append(run_sharded(arm, args, tmp / f"sharded_{arm}_{rep}"))
    rows = []
    for arm, records in runs.items():
        speed = [(r["steps"] - 1) / r["span_s"] for r in records]
        cpu = [1000 * r["cpu_span_s"] / (r["steps"] - 1) for r in records]
        rows.append({"arm": arm, "baseline": SHARDED_BASELINES[arm], "steps_per_s": statistics.median(speed),
                     "raw_speed": speed, "cpu_ms_per_step": statistics.median(cpu), "raw_cpu_ms_per_step": cpu,
                     **{k: max(r[k] for r in records) for k in ("peak_rss_bytes", "merge_extra_bytes",
                                                                 "checkpoint_extra_bytes")},
                     "model_bytes": records[0]["model_bytes"], "own_state_bytes": records[0]["own_state_bytes"]})
    by_arm = {r["arm"]: r for r in rows}
    for r in rows:
        base = by_arm[r["baseline"]]
        r["relative_speed"] = r["steps_per_s"] / base["steps_per_s"]
        r["relative_cpu"] = base["cpu_ms_per_step"] / r["cpu_ms_per_step"]
    mb = lambda x: fmt(x / 2**20, ".1f")  # noqa: E731
    table = markdown_table(
        ["arm", "against", "steps/s (rank 0)", "× baseline", "repeats", "CPU ms/step (rank 0)",
         "baseline's CPU / arm's", "repeats (CPU ms)", "rank 0 peak RSS MB", "merge: peak extra MB",
         "checkpoint: peak extra MB", "rank 0 own state MB", "model MB"],
        [[r["arm"], r["baseline"], fmt(r["steps_per_s"], ".2f"), fmt(r["relative_speed"], ".3f"),
          " / ".join(fmt(x, ".2f") for x in r["raw_speed"]), fmt(r["cpu_ms_per_step"], ".1f"),
          fmt(r["relative_cpu"], ".3f"), " / ".join(fmt(x, ".1f") for x in r["raw_cpu_ms_per_step"]),
          mb(r["peak_rss_bytes"]), mb(r["merge_extra_bytes"]) if r["arm"].startswith("hdet") else "—",
          mb(r["checkpoint_extra_bytes"]), mb(r["own_state_bytes"]), mb(r["model_bytes"])] for r in rows])
    return rows, table


if __name__ == "__main__":
    main()
