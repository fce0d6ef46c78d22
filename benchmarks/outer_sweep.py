"""Issue 60's sweep of the outer step: which outer lr, momentum and momentum schedule (warm-up and restarts on or
off) end each workload best, at W = 2, 4 and 8 workers, asynchronously and in DiLoCo, and which single setting per
mode comes within 5 % of every cell's best without ever diverging?

A one-process simulation, as ``benchmarks/outer_stability.py``, that drives the package's real outer side
(``OuterSettings.build`` -> ``OuterState.process``: Delayed Nesterov, the momentum schedule, the push checks) with
fake workers, each training a real model on its shard of the data for ``H`` inner steps per round and keeping its
own inner optimizer's state between rounds. Workloads (equal samples: ``S`` inner steps per worker of batch 32,
against DDP taking ``S`` steps of batch ``W`` × 32 at the same inner optimizer and lr, in the same process):

- ``tabular_small``: the MLP of ``benchmarks/common.py`` on its 1,024-row tabular set, which the budget reads 12
  (W = 2) to 50 (W = 8) times; AdamW lr 3e-3 (weight decay 0.1) and SGD lr 0.05 (momentum 0.9) inside;
- ``shapes_small``: the conv net (width 8) on the 1,536 small images, read 5 to 20 times; AdamW lr 5e-3;
- ``tabular``: the MLP on 16,384 rows, read 0.8 to 3 times (fresh data); AdamW;
- ``char_lm`` (asked for by name, not in the default run): benchmark 3's char LM (``benchmarks/async_published.py``:
  d_model 64, 2 layers, context 64, batch 16, AdamW lr 1e-2, weight decay 0.1, warm-up S/10 then cosine to 10 %)
  on the stdlib corpus's training split, read under once (fresh data); held-out: blocks of its validation split;
- ``boring``: Lightning's BoringModel with SGD (``outer_stability.Workers``), 200 rounds per worker, shards and
  whole datasets per worker: the stability check, scored by its final ÷ initial held-out loss.

``S`` = 200 (shapes: 120), ``H`` = 10 (``boring``: 8); the first workload named (``tabular_small`` by default) with
AdamW also runs at ``H`` = 25 and 50 (W = 4; ``--h-sweep``). Settings: lr 0.163 (the default), 0.35, 0.5, 0.7 and
1.0 at momentum 0.9, and 0.375, 0.5, 0.7 and 1.0 at 0.5, each with the momentum schedule on and off; two outer lrs
that follow the workers' agreement (:class:`AgreementLR`, ``/agree...`` in the labels); and two chosen at every
update by a one-step lookahead on a held-out split the reported loss does not use (the package's
``DelayedNesterov(lookahead=LookaheadLR(low, high))``, ``/look...``).
Reported per cell: the best fixed setting and its final held-out loss ÷ DDP's; each setting's loss ÷ that best
(``boring``: its final ÷ initial loss, which reaches 1e-15 and whose ratios are round-off); a setting is *unstable*
where any run ended above its start, not finite, or (``boring``) rose by more than 10 % over its last 150 rounds.
Per mode, the chosen default: the stable setting whose worst ratio to the best over the model cells is smallest.
Finished cells are kept in ``outer_sweep[_quick].partial.json`` until the table is written: a run stopped half-way
resumes from them.

Run: ``python benchmarks/outer_sweep.py [--quick] [--seeds S] [--workloads ...] [--workers ...] [--modes ...]
[--h-sweep ...] [--settings ...]``; the char LM's cells: ``--workloads char_lm --name outer_sweep_char_lm`` (a
partial file per name: runs of disjoint cells under one name can be merged into it and resumed).
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.nn.utils import parameters_to_vector

from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish
from benchmarks.outer_stability import build_outer, drive, held_out_loss, simulate, verdict
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.lookahead import LookaheadLR
from lightning_hdet.asynchronous.outer.momentum import outer_from
from lightning_hdet.demos.char_lm import CharLM, warmup_cosine as char_lm_schedule
from lightning_hdet.demos.corpus import BlockDataset, load_corpus
from lightning_hdet.demos.optim import make_optimizer
from lightning_hdet.demos.shapes import ShapesCNN, make_shapes
from lightning_hdet.demos.tabular import TabularMLP, make_tabular

NAME = "outer_sweep"
MODES = ("async", "sync")
WORKERS = (2, 4, 8)
#: (momentum, outer lrs swept at it): from the default (0.163) to past the published lr at 0.9; at 0.5 from the lr
#: ``stable_outer_lr`` takes there (0.375).
GRID = ((0.9, (0.163, 0.35, 0.5, 0.7, 1.0)), (0.5, (0.375, 0.5, 0.7, 1.0)))
#: The agreement-scaled outer lr tried (``k0, low, high``, :class:`AgreementLR`) at 0.375 / 0.5 / on: shrink-only
#: and both ways. Not a package option: issue 60's trial, not shipped (docs/research/2026-11-async.md).
AGREEMENT = ((0.2, 0.25, 1.0), (0.2, 0.25, 4.0))
#: The lookahead outer lr tried (``lr, momentum, schedule, low, high``, the package's ``LookaheadLR``): from the old
#: default's step and from the default's.
LOOKAHEAD = ((0.163, 0.9, "on", 0.05, 1.0), (0.375, 0.5, "on", 0.1, 1.0))
#: The momentum schedule: warm-up over 16 momentum updates and a restart every 8 (the presets'), or none.
SCHEDULES = {"on": (16, 8), "off": (0, 0)}
BATCH = 32
H = 10
#: inner optimizer -> (lr, weight decay) per model workload.
INNER = {"tabular_small": {"adamw": (3e-3, 0.1), "sgd": (0.05, 0.0)}, "shapes_small": {"adamw": (5e-3, 0.1)},
         "tabular": {"adamw": (3e-3, 0.1)}, "char_lm": {"adamw": (1e-2, 0.1)}}
#: Inner steps per worker (equal samples: DDP takes as many steps of W times the batch).
STEPS = {"tabular_small": 200, "shapes_small": 120, "tabular": 200, "char_lm": 200}
#: Per-worker batch where not :data:`BATCH` (the char LM's, benchmark 3's).
BATCHES = {"char_lm": 16}
#: Workloads whose inner lr follows benchmark 3's schedule (:func:`warmup_cosine`) rather than staying constant.
SCHEDULED = ("char_lm",)
#: The char LM's sizes (benchmark 3's) and its held-out blocks: the first ``CHAR_HELD_OUT`` of the validation split
#: for the reported loss, the next as many for the lookahead's score.
CHAR_LM = {"d_model": 64, "n_layers": 2, "block_size": 64}
CHAR_HELD_OUT = 256
#: The ``H`` sweep: these local step counts at W = 4 on the first workload with AdamW, beside ``H``.
H_SWEEP = (25, 50)
BORING_ROUNDS = 200


@dataclass(frozen=True)
class Outer:
    """One outer setting: Delayed Nesterov's lr and momentum, the momentum schedule on or off, and optionally the
    lr scaled by the workers' agreement (``k0, low, high`` of :class:`AgreementLR`) or chosen by a lookahead
    (``low, high`` of the package's ``LookaheadLR``)."""

    lr: float
    momentum: float
    schedule: str
    agreement: tuple[float, float, float] | None = None
    lookahead: tuple[float, float] | None = None

    @property
    def optimizer(self) -> DelayedNesterov:
        """The object that runs it (in DiLoCo, Delayed Nesterov with N = 1: Nesterov with this schedule)."""
        warmup, restart = SCHEDULES[self.schedule]
        look = LookaheadLR(low=self.lookahead[0], high=self.lookahead[1]) if self.lookahead else None
        return DelayedNesterov(lr=self.lr, momentum=self.momentum, warmup=warmup, restarts=restart, lookahead=look)

    @property
    def label(self) -> str:
        k0, low, high = self.agreement or (0, 0, 0)
        look = f"/look[{self.lookahead[0]:g},{self.lookahead[1]:g}]" if self.lookahead else ""
        return f"{self.lr:g}/{self.momentum:g}/{self.schedule}" + (f"/agree{k0:g}[{low:g},{high:g}]" if k0 else "") + look

    def drive(self, state: Any) -> Any:
        """What drives ``state``: itself (a lookahead is inside it), or it with the agreement-scaled lr."""
        return AgreementLR(state, *self.agreement) if self.agreement else state


def agreement(gradients: list[torch.Tensor]) -> float:
    """The pushes' mean pairwise cosine weighted by their norms, ``(|sum g|^2 - sum |g|^2) / ((W - 1) sum |g|^2)``:
    1 when they agree, 0 when orthogonal, -1 / (W - 1) when they cancel (workers fitting their own data)."""
    squares = sum(float(g.norm()) ** 2 for g in gradients)
    total = float(torch.stack(gradients).sum(0).norm()) ** 2
    return (total - squares) / ((len(gradients) - 1) * squares) if squares > 0 else 0.0


class AgreementLR:
    """The outer state with its lr scaled before each update by the workers' agreement ``k`` (:func:`agreement`,
    each new value averaged with the last): ``lr = base * clip(k / k0, low, high)``. DiLoCo: the round's pushes;
    async: each worker's latest push. Why: where the workers fit their own shards of repeated data their
    pseudo-gradients cancel (``k`` near 0, and small outer steps end best); where they agree, larger ones do."""

    def __init__(self, state: Any, k0: float, low: float, high: float) -> None:
        self.state, self.k0, self.low, self.high = state, k0, low, high
        self.base = [group["lr"] for group in state.optimizer.param_groups]
        self.latest: dict[int, torch.Tensor] = {}
        self.k: float | None = None

    @property
    def params(self) -> torch.Tensor:
        return self.state.params

    def process(self, pushes: list) -> Any:
        self.latest.update({p.worker: p.pseudo_gradient for p in pushes})
        gradients = [p.pseudo_gradient for p in pushes] if len(pushes) > 1 else list(self.latest.values())
        if len(gradients) > 1:
            k = agreement(gradients)
            self.k = k if self.k is None else 0.5 * (self.k + k)
            scale = min(self.high, max(self.low, self.k / self.k0))
            for group, base in zip(self.state.optimizer.param_groups, self.base):
                group["lr"] = base * scale
        return self.state.process(pushes)


def candidates(quick: bool) -> list[Outer]:
    if quick:
        return [Outer(0.163, 0.9, "on"), Outer(0.7, 0.9, "off")]
    return [Outer(lr, m, s) for m, lrs in GRID for lr in lrs for s in SCHEDULES] + [
        Outer(0.375, 0.5, "on", a) for a in AGREEMENT] + [Outer(lr, m, s, lookahead=(low, high))
                                                          for lr, m, s, low, high in LOOKAHEAD]


def load(workload: str) -> tuple:
    """(model factory, training inputs, labels, held-out inputs, labels): the data of ``benchmarks/common.py``'s
    workloads of these names (tabular: task seed 0; held-out: 512 other rows or images; the char LM: its training
    split's blocks, held-out the first :data:`CHAR_HELD_OUT` of its validation split)."""
    if workload == "char_lm":
        return (CharLMLogits, *char_blocks("train"), *char_blocks("val", 0, CHAR_HELD_OUT))
    if workload == "shapes_small":
        return (lambda: ShapesCNN(width=8), *make_shapes(1536, seed=0), *make_shapes(512, seed=1))
    rows = 1024 if workload == "tabular_small" else 16384
    return (TabularMLP, *make_tabular(rows, seed=0, task_seed=0), *make_tabular(512, seed=1, task_seed=0))


class Batches:
    """Batches of ``size`` rows of ``(x, y)``, reshuffled every epoch (a ``DistributedSampler`` over a shard)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, size: int, seed: int) -> None:
        self.x, self.y, self.size = x, y, size
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.at = torch.randperm(len(x), generator=self.gen), 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.at + self.size > len(self.x):
            self.order, self.at = torch.randperm(len(self.x), generator=self.gen), 0
        idx = self.order[self.at:self.at + self.size]
        self.at += self.size
        return self.x[idx], self.y[idx]


class ModelWorkers:
    """``W`` fake workers of a real model: each its shard ``w::W`` of the data, its own inner optimizer (state kept
    between rounds, as a worker's is; with ``total_steps``, its lr on :func:`warmup_cosine` over its own steps),
    ``local_steps`` steps of ``batch`` rows per round from the global parameters it is given."""

    def __init__(self, model: torch.nn.Module, x, y, workers: int, inner: str, lr: float, wd: float,
                 local_steps: int, seed: int, batch: int = BATCH, total_steps: int = 0) -> None:
        self.local_steps = local_steps
        self.models = [copy.deepcopy(model) for _ in range(workers)]
        self.opts = [make_optimizer(inner, m.parameters(), lr, wd) for m in self.models]
        self.scheds = [warmup_cosine(o, total_steps) if total_steps else None for o in self.opts]
        self.data = [Batches(x[w::workers], y[w::workers], batch, 1000 * seed + w) for w in range(workers)]

    def round(self, worker: int, start: torch.Tensor) -> torch.Tensor:
        model, opt, data, sched = self.models[worker], self.opts[worker], self.data[worker], self.scheds[worker]
        load_flat(model, start)
        for _ in range(self.local_steps):
            train_step(model, opt, *data.next())
            if sched is not None:
                sched.step()
        with torch.no_grad():
            return start - parameters_to_vector(model.parameters())


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def warmup_cosine(opt: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Benchmark 3's inner schedule: ``CharLM``'s ``"cosine"`` with ``warmup_steps`` = S/10 (at least 1)."""
    return char_lm_schedule(opt, max(total // 10, 1), total)


class CharLMLogits(torch.nn.Module):
    """Benchmark 3's :class:`CharLM` with its logits laid out as ``cross_entropy`` takes them for ``(batch, time)``
    targets, ``(batch, vocab, time)``: the mean over every token, as the module's own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = CharLM(**CHAR_LM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens).transpose(1, 2)


def char_blocks(split: str, first: int = 0, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``first .. first + count`` of the corpus's ``split`` (``"train"`` or ``"val"``) as benchmark 3's
    ``BlockDataset`` cuts them: inputs ``(n, 64)`` and their targets, shifted by one byte."""
    blocks = BlockDataset(getattr(load_corpus(), split), CHAR_LM["block_size"])
    count = len(blocks) - first if count is None else count
    if first + count > len(blocks):
        raise ValueError(f"blocks {first}..{first + count} asked of the {len(blocks)} of the {split} split")
    inputs, targets = zip(*(blocks[i] for i in range(first, first + count)))
    return torch.stack(inputs), torch.stack(targets)


@torch.no_grad()
def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy the flat parameters into ``model`` (``vector_to_parameters`` would make them views of ``flat``)."""
    at = 0
    for p in model.parameters():
        p.copy_(flat[at:at + p.numel()].view_as(p))
        at += p.numel()


def lookahead_split(workload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """512 more held-out rows or images (seed 2) for the lookahead's score, the char LM's next
    :data:`CHAR_HELD_OUT` validation blocks: not the reported loss's."""
    if workload == "char_lm":
        return char_blocks("val", CHAR_HELD_OUT, CHAR_HELD_OUT)
    return make_shapes(512, seed=2) if workload == "shapes_small" else make_tabular(512, seed=2, task_seed=0)


def held_out(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The held-out cross-entropy of ``model`` at flat parameters."""
    def score(flat: torch.Tensor) -> float:
        with torch.no_grad():
            load_flat(model, flat)
            return float(torch.nn.functional.cross_entropy(model(x), y))
    return score


def ddp_loss(workload: str, inner: str, workers: int, seed: int) -> float:
    """DDP at equal samples: ``S`` steps of batch ``W`` × 32 on the whole training set."""
    make, x, y, vx, vy = load(workload)
    torch.manual_seed(seed)
    model = make()
    lr, wd = INNER[workload][inner]
    opt = make_optimizer(inner, model.parameters(), lr, wd)
    sched = warmup_cosine(opt, STEPS[workload]) if workload in SCHEDULED else None
    data = Batches(x, y, BATCHES.get(workload, BATCH) * workers, 1000 * seed)
    for _ in range(STEPS[workload]):
        train_step(model, opt, *data.next())
        if sched is not None:
            sched.step()
    return held_out(copy.deepcopy(model), vx, vy)(parameters_to_vector(model.parameters()).detach())


def model_run(workload: str, inner: str, workers: int, mode: str, local_steps: int, outer: Outer, seed: int
              ) -> dict:
    make, x, y, vx, vy = load(workload)
    torch.manual_seed(seed)
    model = make()
    lr, wd = INNER[workload][inner]
    fake = ModelWorkers(model, x, y, workers, inner, lr, wd, local_steps, seed, BATCHES.get(workload, BATCH),
                        STEPS[workload] if workload in SCHEDULED else 0)
    look = held_out(copy.deepcopy(model), *lookahead_split(workload)) if outer.lookahead else None
    state = build_outer(parameters_to_vector(model.parameters()).detach().clone(), workers, mode, local_steps,
                        outer.optimizer, look and (lambda params, buffers: look(params)))
    curve = drive(outer.drive(state), fake, workers, mode, STEPS[workload] // local_steps, seed,
                  held_out(model, vx, vy))
    finite = all(math.isfinite(c) for c in curve)
    return {"start": curve[0], "final": curve[-1] if finite else math.inf,
            "stable": finite and curve[-1] < curve[0]}


def boring_run(data: str, workers: int, mode: str, outer: Outer, seed: int, rounds: int) -> dict:
    score = functools.partial(held_out_loss, seed=98)
    curve = simulate(workers, mode, outer.optimizer, "sgd", rounds, seed, data, wrap=outer.drive,
                     score=(lambda params, buffers: score(params)) if outer.lookahead else None)
    v = verdict(curve, min(50, rounds // 2))
    return {"start": 1.0, "final": v["end"], "stable": v["stable"]}


def cells(args: argparse.Namespace) -> list[tuple]:
    """(workload, inner or data, W, mode, H) of every cell the arguments ask for."""
    out = []
    for workload in args.workloads:
        if workload == "boring":
            out += [("boring", d, w, m, 8) for d, w, m in itertools.product(("shards", "whole"), WORKERS, MODES)]
            continue
        out += [(workload, i, w, m, H) for i, w, m in itertools.product(INNER[workload], args.workers, args.modes)]
        if workload == args.workloads[0] and not args.quick:
            out += [(workload, "adamw", 4, m, h) for h, m in itertools.product(args.h_sweep, args.modes)]
    return out


def run_cell(cell: tuple, outers: list[Outer], seeds: list[int], rounds: int) -> dict:
    workload, inner, workers, mode, local_steps = cell
    runs = {}
    for outer in outers:
        results = [boring_run(inner, workers, mode, outer, s, rounds) if workload == "boring" else
                   model_run(workload, inner, workers, mode, local_steps, outer, s) for s in seeds]
        runs[outer.label] = {"final": sum(r["final"] for r in results) / len(results),
                             "stable": all(r["stable"] for r in results)}
    ddp = None if workload == "boring" else sum(ddp_loss(workload, inner, workers, s) for s in seeds) / len(seeds)
    return {"cell": list(cell), "ddp": ddp, "runs": runs}


def choose(results: list[dict], mode: str, labels: list[str]) -> list[tuple[str, float, bool]]:
    """Each setting's worst ratio to its cell's best over ``mode``'s cells and whether it was stable in all of
    them, best first (stable before unstable)."""
    mine = [r for r in results if r["cell"][3] == mode and r["ddp"] is not None]
    everywhere = [r for r in results if r["cell"][3] == mode]
    rows = []
    for label in labels:
        worst = max(r["runs"][label]["final"] / _best(r)[1] for r in mine)
        rows.append((label, worst, all(r["runs"][label]["stable"] for r in everywhere)))
    return sorted(rows, key=lambda t: (not t[2], t[1]))


def _best(result: dict) -> tuple[str, float]:
    """The cell's best *fixed* setting (``lr/momentum/schedule``: an adaptive one is measured against it)."""
    label = min((k for k in result["runs"] if k.count("/") == 2), key=lambda k: result["runs"][k]["final"])
    return label, result["runs"][label]["final"]


def default_label() -> str:
    """The package's default outer step (``outer="stable"``) as a sweep label."""
    outer = outer_from(None)
    return Outer(outer.lr, outer.momentum, "on" if (outer.warmup, outer.restarts) == SCHEDULES["on"] else "off").label


def table(results: list[dict], labels: list[str], seeds: list[int], rounds: int) -> str:
    modes = [m for m in MODES if any(r["cell"][3] == m and r["ddp"] is not None for r in results)]  # --modes
    chosen = {m: choose(results, m, labels) for m in modes}
    default, published = default_label(), "0.7/0.9/off"
    look = Outer(*LOOKAHEAD[-1][:3], lookahead=LOOKAHEAD[-1][3:]).label  # the default's step with the lookahead
    pick = {m: chosen[m][0][0] for m in modes}
    rows = []
    for r in results:
        workload, inner, workers, mode, h = r["cell"]
        label, best = _best(r)
        cols = [workload, inner, str(workers), "DiLoCo" if mode == "sync" else "async", str(h), f"`{label}`",
                fmt(best / r["ddp"], ".2f") if r["ddp"] else f"{best:.1e}"]
        for lab in (pick.get(mode), default, look, published):
            run = r["runs"].get(lab)
            value = None if run is None else (fmt(run["final"] / best, ".2f") if r["ddp"] else f"{run['final']:.1e}")
            cols.append("–" if run is None else value + ("" if run["stable"] else " ✗"))
        rows.append(cols)
    head = ["workload", "inner / data", "W", "mode", "H", "best fixed lr/momentum/schedule", "best ÷ DDP",
            "chosen ÷ best", f"default {default} ÷ best", f"`{look}` ÷ best", f"{published} ÷ best"]
    # a list, not a table: the adaptive settings' labels are too long for four columns on a page
    summary = "\n".join(f"- {'DiLoCo' if m == 'sync' else 'async'}: " + ", ".join(
        f"`{lab}` {w:.2f}{'' if ok else ' ✗'}" for lab, w, ok in chosen[m][:3]) for m in modes)
    return (f"Outer settings `lr/momentum/schedule` (schedule on: momentum warm-up 16 and restart every 8), "
            f"{len(labels)} swept; seeds {seeds}; final held-out loss (mean over seeds); boring: {rounds} rounds per "
            "worker, every number its final ÷ initial loss (no ratio to the best: round-off there). ✗: some run "
            "ended above its start, not finite, or rose over its last rounds. Chosen per mode: "
            "the stable setting with the smallest worst ratio to each cell's best.\n\n"
            + markdown_table(head, rows) + "\n\nThe three best settings per mode (worst ratio to the best over its "
            "cells):\n\n" + summary)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..n-1 (default 1)")
    p.add_argument("--workloads", nargs="+", default=["tabular_small", "shapes_small", "tabular", "boring"],
                   choices=["tabular_small", "shapes_small", "tabular", "boring", "char_lm"])
    p.add_argument("--workers", nargs="+", type=int, default=list(WORKERS), help="W of the model workloads")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="of the model workloads")
    p.add_argument("--h-sweep", nargs="*", type=int, default=list(H_SWEEP),
                   help=f"H of the extra W = 4 cells of the first workload (default {list(H_SWEEP)}; none: no extra)")
    p.add_argument("--name", default=NAME, help=f"results file and docs block (default {NAME}; another keeps its "
                   "table: the char LM's is outer_sweep_char_lm)")
    p.add_argument("--settings", nargs="+", default=None, metavar="LABEL",
                   help="run only these settings' labels (default all; e.g. the char LM's 18 fixed and one lookahead)")
    add_output_args(p)
    args = p.parse_args(argv)
    name, t0 = begin(args.name, args.quick)
    torch.set_num_threads(1)
    logging.getLogger("lightning_hdet").setLevel(logging.ERROR)  # the push checks' rejections of diverging runs
    if args.quick:
        STEPS.update({k: 40 for k in STEPS})
    outers, seeds = candidates(args.quick), list(range(args.seeds))
    if args.settings:
        unknown = set(args.settings) - {o.label for o in outers}
        if unknown:
            p.error(f"--settings {sorted(unknown)}: not among {[o.label for o in outers]}")
        outers = [o for o in outers if o.label in args.settings]
    rounds = 20 if args.quick else BORING_ROUNDS
    labels = [o.label for o in outers]
    partial = args.results_dir / f"{name}.partial.json"
    sizes = {"labels": labels, "seeds": seeds, "steps": STEPS, "rounds": rounds}
    done = {tuple(r["cell"]): r for r in _resumable(partial, sizes)}
    results = []
    for cell in cells(args):
        results.append(done.get(cell) or run_cell(cell, outers, seeds, rounds))
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({**sizes, "results": results}, default=float))
        print(*cell, _best(results[-1]), f"{time.perf_counter() - t0:.0f}s", flush=True)
    payload = {"results": results, "total_wall_s": time.perf_counter() - t0}
    publish(name, args, payload, table(results, labels, seeds, rounds), seeds=seeds)
    partial.unlink()
    return payload


def _resumable(partial: Path, sizes: dict) -> list[dict]:
    """The cells a stopped run of the same settings finished (none when it ran others)."""
    if not partial.exists():
        return []
    saved = json.loads(partial.read_text())
    return saved["results"] if {k: saved.get(k) for k in sizes} == json.loads(json.dumps(sizes)) else []


if __name__ == "__main__":
    main()
