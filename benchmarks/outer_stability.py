"""Issue 42's long-horizon stability check of the outer step: does the global model keep improving over hundreds of
rounds per worker, for W = 2, 4 and 8 workers, asynchronously and in DiLoCo, at each outer preset?

A pure simulation that drives the package's real outer side (``OuterSettings.build`` -> ``OuterState.process``:
Delayed Nesterov, the momentum schedule, the push checks) with fake workers, so that 200+ rounds per worker cost
seconds instead of hours of multi-process fits. Each worker holds a shard of Lightning's ``BoringModel`` task (a
32 -> 2 linear regression onto ones, 64 training inputs, batch size 1, the shards taken in order as a
``DistributedSampler`` without shuffling does: ``--data shards``) or, as an elastic worker does, 64 inputs of its
own, the whole of its dataset in order (``--data whole``: a worker's directions come back only every 8 rounds), and
runs ``H`` inner steps of its own optimizer per round:

- ``sgd``: SGD lr 0.05, ``H`` = 8, the issue's case;
- ``adamw``: AdamW lr 0.01, weight decay 0.1, ``H`` = 8 (a floor above 0: weight decay moves the optimum).

Async: each round takes 1 + U(0, 0.1) time units, pushes are applied in arrival order and the worker pulls the new
model (``workers - 1`` pushes stale); DiLoCo: every worker starts each round from the same model and one outer step
takes their mean. Reported: the global model's loss on 256 held-out inputs ÷ its initial loss after 50 rounds per
worker and at the end, and end ÷ 50 rounds (> 1: the loss rose over the long horizon), the worst over seeds.

Run: ``python benchmarks/outer_stability.py [--quick] [--rounds R] [--seeds S] [--data shards whole]``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import math
import sys
from collections.abc import Callable
from typing import Any
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.lookahead import Score
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.wire.messages import Kind, Push

NAME = "outer_stability"
#: Inner optimizer, its lr and H per task.
TASKS = {"sgd": ("sgd", 0.05, 8), "adamw": ("adamw", 0.01, 8)}
OUTERS = ("stable", "robust", "published")
MODES = ("async", "sync")
WORKERS = (2, 4, 8)
#: How each worker's data is drawn: a shard of one dataset (the Trainer's ``DistributedSampler``), or a dataset of
#: its own read whole (an elastic worker: each session its own data, here 64 inputs per worker).
DATA = ("shards", "whole")
#: A loss below this fraction of the initial one counts as converged: "rose" is not read into noise at the floor.
FLOOR = 1e-4


class Workers:
    """``W`` fake workers on the BoringModel regression (inputs with a constant 1 for the bias): shards of one
    dataset, or each a dataset of its own (see :data:`DATA`)."""

    def __init__(self, workers: int, task: str, seed: int, data: str = "shards") -> None:
        inner, lr, self.local_steps = TASKS[task]
        if data == "shards":
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
            self.shards = [_with_bias(x)[w::workers] for w in range(workers)]
        else:  # worker 0 holds the shards' dataset, the others their own (as sessions seeded seed + s)
            self.shards = [_with_bias(torch.randn(64, 32, generator=torch.Generator().manual_seed(seed + 7919 * w)))
                           for w in range(workers)]
        self.params = [torch.zeros(2, 33) for _ in range(workers)]
        self.opts = [torch.optim.SGD([p], lr=lr) if inner == "sgd" else torch.optim.AdamW([p], lr=lr, weight_decay=0.1)
                     for p in self.params]
        self.position = [0] * workers

    def round(self, worker: int, start: torch.Tensor) -> torch.Tensor:
        """``H`` inner steps from the flat global parameters ``start``; the pseudo-gradient ``start - local``."""
        p, shard = self.params[worker], self.shards[worker]
        p.copy_(torch.cat([start[:64].view(2, 32), start[64:, None]], 1))
        for _ in range(self.local_steps):
            x = shard[self.position[worker] % len(shard)]
            self.position[worker] += 1
            p.grad = (p @ x - 1)[:, None] * x[None, :]  # d/dp of the mean over 2 outputs of (p x - 1)^2
            self.opts[worker].step()
        return start - torch.cat([p[:, :32].flatten(), p[:, 32]])


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(len(x), 1)], 1)


def held_out_loss(flat: torch.Tensor, seed: int = 99) -> float:
    """Mean squared error onto ones on 256 fixed held-out inputs (as benchmarks/async_defaults.py), drawn with
    ``seed``."""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return float(((x @ flat[:64].view(2, 32).T + flat[64:] - 1) ** 2).mean())


def simulate(workers: int, mode: str, outer: OuterOptimizer | str | None, task: str, rounds: int, seed: int,
             data: str = "shards", wrap: Callable[[OuterState], Any] | None = None, score: Score | None = None
             ) -> list[float]:
    """The global model's held-out loss at the start and after each round per worker; ``outer``: a preset's name or
    an outer optimizer object; ``wrap``: what drives the outer state instead of it (``.process``, ``.params``);
    ``score``: a lookahead's."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(32, 2)
    flat = torch.cat([linear.weight.detach().flatten(), linear.bias.detach()]).clone()
    fake = Workers(workers, task, seed, data)
    state = build_outer(flat, workers, mode, fake.local_steps, outer, score)
    return drive(wrap(state) if wrap else state, fake, workers, mode, rounds, seed, held_out_loss)


def build_outer(flat: torch.Tensor, workers: int, mode: str, local_steps: int,
                outer: OuterOptimizer | str | None, score: Score | None = None) -> OuterState:
    """The package's outer side over the flat parameters ``flat`` (no buffers), rounds of fixed length."""
    return OuterSettings(mode=mode, local_steps=local_steps, outer=outer).build(
        flat, torch.zeros(0), workers, None, score=score)


def drive(state: OuterState, fake, workers: int, mode: str, rounds: int, seed: int,
          score: Callable[[torch.Tensor], float]) -> list[float]:
    """``rounds`` rounds per worker of ``fake`` (``.round(worker, start)`` -> pseudo-gradient, ``.local_steps``)
    through ``state``: DiLoCo's, or async pushes in arrival order (each round takes 1 + U(0, 0.1) time units);
    ``score`` of the global parameters at the start and after each round per worker."""
    curve = [score(state.params)]
    if mode == "sync":
        for _ in range(rounds):
            start = state.params.clone()
            _process(state, [(w, fake.round(w, start)) for w in range(workers)], fake.local_steps)
            curve.append(score(state.params))
        return curve
    clock = torch.Generator().manual_seed(seed + 1)
    duration = lambda: 1.0 + 0.1 * float(torch.rand(1, generator=clock))  # noqa: E731
    starts = {w: state.params.clone() for w in range(workers)}
    queue = [(duration(), w) for w in range(workers)]
    heapq.heapify(queue)
    for push in range(1, rounds * workers + 1):
        t, w = heapq.heappop(queue)
        _process(state, [(w, fake.round(w, starts[w]))], fake.local_steps)
        starts[w] = state.params.clone()
        heapq.heappush(queue, (t + duration(), w))
        if push % workers == 0:
            curve.append(score(state.params))
    return curve


def _process(state: OuterState, pushes: list[tuple[int, torch.Tensor]], steps: int) -> None:
    state.process([Push(w, Kind.PUSH, steps, 1.0, 0.0, g) for w, g in pushes])


def verdict(curve: list[float], middle: int) -> dict:
    """The curve's ratios to its start after ``middle`` rounds and at the end, and end ÷ middle."""
    start, mid, end = curve[0], curve[middle], curve[-1]
    finite = math.isfinite(end) and end < 1e30
    rose = finite and end > 1.1 * mid and end > FLOOR * start
    return {"mid": mid / start, "end": end / start if finite else math.inf,
            "rise": end / mid if finite and mid > 0 else math.inf, "stable": finite and end < start and not rose}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds per worker (default 200; --quick: 60)")
    p.add_argument("--seeds", type=int, default=None, help="seeds (default 3; --quick: 1)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--data", nargs="+", default=list(DATA), choices=DATA, help="each worker's data (see DATA)")
    add_output_args(p)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (60 if args.quick else 200)
    args.seeds = args.seeds or (1 if args.quick else 3)
    name, _ = begin(NAME, args.quick)
    logging.getLogger("lightning_hdet").setLevel(logging.ERROR)  # the push checks' rejections of diverging runs
    middle = min(50, args.rounds // 2)
    runs = []
    for data, task, mode, outer in itertools.product(args.data, TASKS, MODES, OUTERS):
        for workers in WORKERS:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                curve = simulate(workers, mode, outer, task, args.rounds, seed, data)
                runs.append({"data": data, "task": task, "mode": mode, "outer": outer, "workers": workers,
                             "seed": seed, **verdict(curve, middle), "curve": curve[:: max(1, args.rounds // 50)]})
            print(data, task, mode, outer, workers, [round(r["end"], 6) for r in runs[-args.seeds:]], flush=True)
    publish(name, args, {"runs": runs}, _table(runs, middle, args.rounds, args.data))


def _table(runs: list[dict], middle: int, rounds: int, datas: list[str]) -> str:
    rows = []
    for data, task, mode, outer in itertools.product(datas, TASKS, MODES, OUTERS):
        cells = []
        for workers in WORKERS:
            sel = [r for r in runs if (r["data"], r["task"], r["mode"], r["outer"], r["workers"]) ==
                   (data, task, mode, outer, workers)]
            worst = max(sel, key=lambda r: r["end"])
            mark = "" if all(r["stable"] for r in sel) else " ✗"
            cells.append(f"{fmt(worst['mid'], '.2g')} / {fmt(worst['end'], '.2g')}{mark}")
        rows.append([data, task, "DiLoCo" if mode == "sync" else "async", f"`{outer}`", *cells])
    head = ["data", "inner", "mode", "outer", *(f"W = {w}" for w in WORKERS)]
    return (f"Loss ÷ initial loss after {middle} / {rounds} rounds per worker, the worst seed; `shards`: each worker "
            "a shard of one 64-input dataset (the Trainer's sampler), `whole`: each worker 64 inputs of its own, "
            "read whole (an elastic worker); ✗: some seed ended above"
            f" its start, not finite, or rose by more than 10 % between the two (above {FLOOR:g} × the start).\n\n"
            + markdown_table(head, rows))


if __name__ == "__main__":
    main()
