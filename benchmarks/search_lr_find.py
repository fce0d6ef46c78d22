"""Benchmark 2's ``lr_find`` arm: what a Lightning user reaches for first (issue 59).

Lightning's own ``Tuner(trainer).lr_find(model, datamodule=..., num_training=100)``, its other arguments at their
defaults as a user would call it, on one process at the per-process batch, from the model built at the starting LR;
then plain DDP on ``W`` processes at its suggestion (as the untuned arm: one process on the whole job's batch, the
same samples) from the same initial weights. Compute: the finder's ``FINDER_STEPS`` one-process steps are counted
whole (also when it stops early on a diverging loss), so the DDP run gets ``S - ceil(FINDER_STEPS / W)`` steps and
the arm spends ``FINDER_STEPS + W × (S - ceil(FINDER_STEPS / W))`` rank-steps: exactly ``W × S`` when ``W`` divides
``FINDER_STEPS``. When the finder suggests nothing (``None``), the DDP run uses the starting LR and the arm records
``fallback: True``.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.tuner import Tuner

from benchmarks.common import RunSpec, best_so_far, build_workload, fit_run

FINDER_STEPS = 100  # Tuner.lr_find's num_training, the user's default


def find_lr(base: RunSpec, work: Path) -> float | None:
    """``Tuner.lr_find``'s suggestion for ``base`` on one process at its batch (``None`` when it has none)."""
    seed_everything(base.seed, verbose=False)
    model, data = build_workload(replace(base, devices=1))
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=work)
    finder = Tuner(trainer).lr_find(model, datamodule=data, num_training=FINDER_STEPS)
    return None if finder is None else finder.suggestion()


def run_lr_find(start_lr: float, base: RunSpec, world: int, work: Path) -> dict:
    """The arm's row (see the module's docstring): ``base`` is a per-process run spec at ``start_lr``."""
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    suggested = find_lr(replace(base, lr=start_lr), work / "finder")
    finder_s = time.perf_counter() - started
    lr = start_lr if suggested is None or not math.isfinite(suggested) else suggested
    spent = math.ceil(FINDER_STEPS / world)
    spec = replace(base, lr=lr, steps=base.steps - spent, devices=1, batch_size=base.batch_size * world,
                   val_batches=base.val_batches // world)
    run = fit_run(spec, work / "ddp")
    curve = best_so_far([(FINDER_STEPS + world * s, loss, secs) for s, loss, secs in run.val_curve])
    return dict(settled_lr=lr, best_val_loss=run.best_val_loss, curve=curve, lrs_tried=[lr],
                diverged_runs=int(run.diverged), wall_s=finder_s + run.wall_s, final_loss=run.final_model_val_loss,
                extra={"suggested_lr": suggested, "fallback": suggested is None, "ddp_steps": spec.steps})
