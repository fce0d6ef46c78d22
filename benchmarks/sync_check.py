"""GPU check for HDET's per-step path: synchronising CUDA calls per training step and steps/s, DDP against HDET.

Each arm is one Lightning fit on ``cuda:0`` over NCCL with one rank (NCCL needs one GPU per rank, and the check
must run on a machine with one GPU): ``ddp`` is Lightning's ``DDPStrategy``; ``hdet`` is ``HDETStrategy`` with one
group and its callback (its DDP communication hook, the on-device non-finite guard, the per-group learning rates
and their logging), with no vote inside the counted steps. Three settings: ``sgd`` (plain SGD, the guard's
"deferred" skip), ``adamw`` (``fused=True``, exact skip through ``found_inf``) and ``adamw-bf16`` (the same under
``precision="bf16-mixed"``). The model is a 4-layer MLP of width 2048 on BoringModel's batches of 2, so a step is
bound by the host's launch and Python work: the steps/s ratio shows per-step host overhead at its largest.

- **Syncs per step**: after ``--warmup`` steps, for ``--count`` steps, ``torch.cuda.set_sync_debug_mode("warn")``
  from each training batch's start to its end, counting the warnings torch raises for a synchronising call
  (``.item()``, a ``bool`` of a device tensor, a blocking copy to the host), with where they came from. HDET's
  target: no more than DDP's.
- **Steps/s**: the rest of the same fit, timed to its last step (``torch.cuda.synchronize`` at both ends, outside
  the steps), sync counting off; each arm a fresh process, arms interleaved over ``--repeats``.

Run: ``python benchmarks/sync_check.py [--out DIR]`` (prints a table, writes ``DIR/sync_check.json``). On a
machine without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARMS = ("ddp", "hdet")
SETTINGS = {"sgd": ("sgd", "32-true"), "adamw": ("adamw", "32-true"), "adamw-bf16": ("adamw", "bf16-mixed")}
SYNC_MESSAGE = "synchronizing"  # torch's warning: "called a synchronizing CUDA operation"


class WideModel(BoringModel):
    """A GPU-sized MLP on BoringModel's random data (4 layers of width 2048; the step time is the GPU's)."""

    def __init__(self, optimizer: str, width: int = 2048) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.layer = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                   nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SyncCounter(Callback):
    """Counts synchronising CUDA calls between each training batch's start and end, for steps in ``[start, stop)``."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.steps = 0
        self.where: Counter[str] = Counter()
        self._catch: Any = None
        self._seen: list[warnings.WarningMessage] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if not self.start <= trainer.global_step < self.stop:
            return
        self._catch = warnings.catch_warnings(record=True)
        self._seen = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)
        self._catch = None
        self.steps += 1
        for w in self._seen:
            if SYNC_MESSAGE in str(w.message):
                self.where[f"{Path(w.filename).name}:{w.lineno}"] += 1


class StepTimer(Callback):
    """Wall time from step ``warmup`` to the end of training, the device synchronised at both ends only."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.steps_per_s = float("nan")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.cuda.synchronize()
        self.steps_per_s = (trainer.global_step - self.warmup) / (time.perf_counter() - self.start)


def fit(arm: str, setting: str, steps: int, warmup: int, count: int) -> dict:
    """One fit in this process: syncs counted for ``count`` steps after ``warmup``, then steps/s to the end."""
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hdet import HDETCallback, HDETStrategy

    optimizer, precision = SETTINGS[setting]
    seed_everything(0, verbose=False)
    counter, timer = SyncCounter(warmup, warmup + count), StepTimer(warmup + count)
    callbacks: list[Callback] = [counter, timer]
    if arm == "hdet":
        strategy: Any = HDETStrategy(num_groups=1, process_group_backend="nccl")
        callbacks.append(HDETCallback(every_n_steps=10 * steps, search=False))  # no vote inside the measured steps
    else:
        strategy = DDPStrategy(process_group_backend="nccl")
    trainer = Trainer(accelerator="cuda", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                      limit_val_batches=0,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks)
    trainer.fit(WideModel(optimizer))
    return {"steps": counter.steps, "syncs": sum(counter.where.values()), "where": dict(counter.where),
            "steps_per_s": timer.steps_per_s}


def run_child(arm: str, setting: str, args: argparse.Namespace, repeat: int) -> dict:
    """Run :func:`fit` in a fresh process (one NCCL process group per process)."""
    out = Path(args.out) / f"{arm}_{setting}_{repeat}.json"
    cmd = [sys.executable, __file__, "--child", arm, setting, "--out", str(out), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--count", str(args.count)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sync_check_out")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("ARM", "SETTING"))
    args = p.parse_args(argv)
    if args.child:
        arm, setting = args.child
        Path(args.out).write_text(json.dumps(fit(arm, setting, args.steps, args.warmup, args.count)))
        return 0
    if not torch.cuda.is_available():
        print("sync_check: no CUDA device, nothing to check")
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for setting in SETTINGS:
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for repeat in range(args.repeats):
            for arm in ARMS:
                runs[arm].append(run_child(arm, setting, args, repeat))
        speeds = {arm: [r["steps_per_s"] for r in runs[arm]] for arm in ARMS}
        for arm in ARMS:
            c = runs[arm][0]  # the counts are the same in every repeat
            mean = sum(speeds[arm]) / len(speeds[arm])
            rows.append({"arm": arm, "setting": setting, "syncs_per_step": c["syncs"] / max(c["steps"], 1),
                         "where": c["where"], "steps_per_s": speeds[arm], "mean_steps_per_s": mean,
                         "relative_to_ddp": mean / (sum(speeds["ddp"]) / len(speeds["ddp"]))})
    (Path(args.out) / "sync_check.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                                "torch": torch.__version__, "rows": rows}, indent=1))
    print("| arm | setting | syncs/step | where | steps/s (repeats) | relative to ddp |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        reps = " / ".join(f"{s:.1f}" for s in r["steps_per_s"])
        where = ", ".join(f"{k} ×{v}" for k, v in sorted(r["where"].items())) or "—"
        print(f"| {r['arm']} | {r['setting']} | {r['syncs_per_step']:.2f} | {where} | {reps} | "
              f"{r['relative_to_ddp']:.3f} |")
    extra = [r for r in rows if r["arm"] == "hdet" and r["syncs_per_step"] > next(
        d["syncs_per_step"] for d in rows if d["arm"] == "ddp" and d["setting"] == r["setting"])]
    print("HDET adds no synchronising call per step" if not extra else
          f"HDET adds synchronising calls per step: {[(r['setting'], r['where']) for r in extra]}")
    return 1 if extra else 0


if __name__ == "__main__":
    sys.exit(main())
