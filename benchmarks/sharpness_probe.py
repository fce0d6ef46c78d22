"""Issue 59, a measurement: does sharpness at the search's decision time tell the LRs that end well from those that
end badly?

Edge-of-stability reading (Cohen et al. 2021, 2022): a run stays stable while ``lr × λ_max < threshold``; above
it the loss oscillates along the sharpest direction and can catapult. For SGD with heavy-ball momentum ``β``
(torch's ``v ← βv + g; p ← p - lr·v``) the threshold on ``lr × λ_max(H)`` is ``2 (1 + β)``; for Adam(W) it is
``(2 + 2β₁) / (1 - β₁)`` on ``lr × λ_max(P⁻¹H)`` with ``P = diag(sqrt(v̂) + ε)``, the preconditioned sharpness.
This script reports ``r = lr × λ / threshold`` (1: the edge).

One process, no HDET: the workloads of ``lightning_hdet.demos`` built as ``search_baselines`` builds them
(``common.build_workload``: data, model, seed), trained on the whole 4-process job's batch (``--batch 128``, the
untuned arm's ``whole_batch``) in a plain loop at a constant LR, for each multiple of the cell's good LR
(``search_baselines.GOOD_LRS``). Every ``--every`` steps it records the training loss (mean since the last
record), the validation loss (the first ``VAL_ITEMS`` held-out items, what HDET's votes read), the held-out loss
``search_baselines`` scores a handed-back model on (the last ``SMALL_TEST`` items, ``common.evaluate``), and
``λ`` by power iteration with Hessian-vector products on a fixed batch of the first ``--sharp-items`` training
items (:func:`top_eigenvalue`; its iterations and last relative change are recorded).

Run: ``python benchmarks/sharpness_probe.py --cells shapes_small:sgd tabular_small:sgd --seeds 0 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SMALL_TEST, RunSpec, begin, build_workload, write_json
from benchmarks.search_baselines import GOOD_LRS
from lightning_hdet.demos.base import shuffle_generator
from lightning_hdet.demos.optim import make_optimizer

NAME = "sharpness_probe"
MULTIPLES = (0.25, 0.5, 1.0, 1.5, 2.3, 3.5, 5.2)  # × the cell's good LR
VAL_ITEMS = 256  # the votes' validation batches at 4 processes: 8 batches of 32
MOMENTUM = 0.9  # demos.optim's SGD
ADAM_BETA1 = 0.9  # torch's AdamW default, which demos.optim keeps


def threshold(optimizer: str, lr: float) -> float:
    """The stability threshold on ``λ`` (of ``H`` for SGD, of ``P⁻¹H`` for AdamW) at ``lr``."""
    if optimizer == "sgd":
        return 2 * (1 + MOMENTUM) / lr
    if optimizer == "adamw":
        return (2 + 2 * ADAM_BETA1) / ((1 - ADAM_BETA1) * lr)
    raise ValueError(f"optimizer={optimizer!r}: the probe knows the threshold of 'sgd' and 'adamw' only")


@dataclass
class Eigen:
    """A power iteration's answer: the Rayleigh quotient ``value``, the ``iterations`` run and the relative change
    of the value at the last one (``rel_change`` < the tolerance: converged)."""

    value: float
    iterations: int
    rel_change: float


def top_eigenvalue(
    loss: Callable[[], Tensor], params: Sequence[Tensor], iters: int = 20, tol: float = 1e-3,
    scale: Sequence[Tensor] | None = None, seed: int = 0,
) -> Eigen:
    """The largest (most positive) eigenvalue of the Hessian of ``loss()`` in ``params`` (with ``scale``, of
    ``S H S`` with ``S = diag(scale)``: ``scale = P^-1/2`` gives ``λ(P⁻¹H)``, the same spectrum), by power
    iteration from a seeded random vector, stopping after ``iters`` Hessian-vector products or when the Rayleigh
    quotient moves by less than ``tol`` (relative). Power iteration finds the eigenvalue of largest magnitude: where
    that one is negative, it is run again on ``S H S - σ I`` (``σ`` that negative value), whose largest is
    ``λ_max - σ``; ``iterations`` counts both runs. The gradient's graph is built once and differentiated again
    per product (double backward), so one product costs about one backward pass."""
    params = list(params)
    grads = torch.autograd.grad(loss(), params, create_graph=True)
    scale = [torch.ones_like(p) for p in params] if scale is None else list(scale)

    def product(vec: list[Tensor]) -> list[Tensor]:
        hv = torch.autograd.grad(grads, params, grad_outputs=[v * s for v, s in zip(vec, scale)], retain_graph=True)
        return [h.detach() * s for h, s in zip(hv, scale)]

    first = _power(product, params, iters, tol, seed, shift=0.0)
    if first.value >= 0:
        return first
    second = _power(product, params, iters, tol, seed, shift=first.value)
    return Eigen(second.value, first.iterations + second.iterations, second.rel_change)


def _power(product: Callable[[list[Tensor]], list[Tensor]], params: Sequence[Tensor], iters: int, tol: float,
           seed: int, shift: float) -> Eigen:
    """Power iteration on ``product - shift × I``; the value returned is the Rayleigh quotient of ``product``."""
    gen = torch.Generator().manual_seed(seed)
    vec = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    value, change = math.nan, math.inf
    for it in range(1, iters + 1):
        norm = torch.sqrt(sum((v * v).sum() for v in vec))
        vec = [v / norm for v in vec]
        hv = product(vec)
        new = float(sum((v * h).sum() for v, h in zip(vec, hv)))
        change = abs(new - value) / max(abs(new), 1e-12) if math.isfinite(value) else math.inf
        value, vec = new, [h - shift * v for h, v in zip(hv, vec)]
        if change < tol:
            break
    return Eigen(value, it, change)


def adam_scale(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> list[Tensor] | None:
    """``P^-1/2`` of AdamW's current state, ``P = diag(sqrt(v̂) + ε)``; ``None`` before its first step."""
    out = []
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                return None
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            out.append((v_hat.sqrt() + eps).rsqrt())
    assert len(out) == len(params), "the optimizer's params must be the probe's, in order"
    return out


@dataclass
class ProbeArgs:
    """What every run of the probe shares."""

    steps: int
    every: int
    batch: int
    sharp_items: int
    iters: int
    tol: float


def probe_run(workload: str, optimizer: str, lr: float, seed: int, args: ProbeArgs,
              switch: tuple[int, float] | None = None) -> dict:
    """Train ``workload`` with ``optimizer`` at a constant ``lr`` from ``seed``'s model and data order, recording
    every ``args.every`` steps (and at step 0) the losses, ``λ`` and ``r`` (at the LR then in use). ``switch =
    (step, factor)`` multiplies the LR by ``factor`` after ``step`` steps: what a vote does to a group."""
    spec = RunSpec(lr=lr, steps=args.steps, seed=seed, batch_size=args.batch, workload=workload,
                   model={"optimizer": optimizer})
    torch.manual_seed(seed)  # what fit_run's seed_everything fixes for the model's initial weights
    model, data = build_workload(spec)
    data.setup("fit")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(optimizer, params, lr, 0.0)
    loader = torch.utils.data.DataLoader(data.train_set, batch_size=args.batch, shuffle=True, drop_last=True,
                                         generator=shuffle_generator(seed))
    sharp_batch = data.train_set[: args.sharp_items]

    def record(step: int, losses: list[float]) -> dict:
        model.eval()  # the demo models have no dropout or batch norm: the mode changes nothing, said for clarity
        with torch.no_grad():
            val = float(model._loss(data.val_set[:VAL_ITEMS]))
            test = float(model._loss(data.val_set[len(data.val_set) - SMALL_TEST:]))  # common.evaluate's score
        scale = adam_scale(opt, params) if optimizer == "adamw" else None
        if optimizer == "adamw" and scale is None:
            eig = Eigen(math.nan, 0, math.nan)  # no preconditioner before AdamW's first step
        else:
            eig = top_eigenvalue(lambda: model._loss(sharp_batch), params, args.iters, args.tol, scale, seed=step)
        train = sum(losses) / len(losses) if losses else math.nan
        return {"step": step, "train": train, "val": val, "test": test, "lam": eig.value, "iters": eig.iterations,
                "rel_change": eig.rel_change, "r": eig.value / threshold(optimizer, opt.param_groups[0]["lr"])}

    rows, losses, step = [record(0, [])], [], 0
    while step < args.steps:
        for batch in loader:
            model.train()
            loss = model._loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step, losses = step + 1, losses + [float(loss.detach())]
            if switch is not None and step == switch[0]:
                for group in opt.param_groups:
                    group["lr"] *= switch[1]
            if step % args.every == 0 or step == args.steps:
                rows.append(record(step, losses))
                losses = []
            if step == args.steps:
                break
    return {"workload": workload, "optimizer": optimizer, "lr": lr, "seed": seed, "rows": rows,
            "final_test": rows[-1]["test"]}


JUMP = 0.10  # a jump: a record's training loss (mean since the last record) 10 % above the run's lowest before it


def first_jump(rows: list[dict]) -> tuple[int | None, float]:
    """The step of a run's first jump (``None``: none) and its largest rise over the lowest earlier training loss."""
    best, step, rise = math.inf, None, 0.0
    for row in rows:
        if not math.isfinite(row["train"]):
            continue
        if math.isfinite(best):
            rise = max(rise, row["train"] / best - 1)
            if step is None and row["train"] > (1 + JUMP) * best:
                step = row["step"]
        best = min(best, row["train"])
    return step, rise


def _at(rows: list[dict], step: int, key: str) -> float:
    return next((row[key] for row in rows if row["step"] == step), math.nan)


def _span(values: list[float], spec: str = ".2f") -> str:
    """Median over seeds with the range: ``m (lo-hi)``."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return "—"
    mid = statistics.median(vals)
    return f"{mid:{spec}}" if len(vals) == 1 else f"{mid:{spec}} ({vals[0]:{spec}}-{vals[-1]:{spec}})"


def _by_cell(runs: list[dict]) -> list[tuple[tuple[str, str], list[dict]]]:
    """The runs grouped by ``(workload, optimizer)``, cells in the order they first appear."""
    cells = dict.fromkeys((r["workload"], r["optimizer"]) for r in runs)
    return [(cell, [r for r in runs if (r["workload"], r["optimizer"]) == cell]) for cell in cells]


def report(runs: list[dict], steps: Sequence[int] = (30, 75, 90, 150, 300)) -> str:
    """Per cell and LR multiple (medians over seeds, ranges): the final held-out loss, ``r`` at ``steps``, its
    largest value, and the jumps (:func:`first_jump`: seeds that jump, their steps, the largest rise)."""
    out = []
    for cell, cell_runs in _by_cell(runs):
        out += [f"**{cell[0]} + {cell[1]}** (good LR {cell_runs[0]['good_lr']:g})", "",
                "| × good LR | final held-out | val at 90 | " + " | ".join(f"r at {s}" for s in steps)
                + " | r max | jumps (steps) | largest rise |", "|---" * (6 + len(steps)) + "|"]
        for mult in sorted({r["multiple"] for r in cell_runs}):
            group = sorted((r for r in cell_runs if r["multiple"] == mult), key=lambda r: r["seed"])
            jumps = [first_jump(r["rows"]) for r in group]
            where = ", ".join(str(s) for s, _ in jumps if s is not None) or "—"
            out.append(f"| {mult:g} | {_span([r['final_test'] for r in group], '.3f')} | "
                       f"{_span([_at(r['rows'], 90, 'val') for r in group], '.3f')} | "
                       + " | ".join(_span([_at(r["rows"], s, "r") for r in group]) for s in steps)
                       + f" | {_span([max(x['r'] for x in r['rows'] if math.isfinite(x['r'])) for r in group])} | "
                       f"{sum(s is not None for s, _ in jumps)}/{len(group)} ({where}) | "
                       f"{_span([rise for _, rise in jumps], '.0%')} |")
        out.append("")
    return "\n".join(out)


def trajectory(runs: list[dict], key: str, every: int = 30, spec: str = ".2f") -> str:
    """Per cell, ``key`` (``r``, ``train``, ...) every ``every`` steps per LR multiple, the median over seeds."""
    out = []
    for cell, cell_runs in _by_cell(runs):
        steps = sorted({row["step"] for r in cell_runs for row in r["rows"] if row["step"] % every == 0})
        out += [f"**{cell[0]} + {cell[1]}: {key}** (median over seeds)", "",
                "| × good LR | " + " | ".join(str(s) for s in steps) + " |", "|---" * (1 + len(steps)) + "|"]
        for mult in sorted({r["multiple"] for r in cell_runs}):
            group = [r for r in cell_runs if r["multiple"] == mult]
            out.append(f"| {mult:g} | " + " | ".join(_span([_at(r["rows"], s, key) for r in group], spec).split(" (")[0]
                                                    for s in steps) + " |")
        out.append("")
    return "\n".join(out)


def max_r(rows: list[dict], until: int) -> float:
    """The largest ``r`` a run recorded up to step ``until`` (NaN: none recorded)."""
    values = [row["r"] for row in rows if row["step"] <= until and math.isfinite(row["r"])]
    return max(values) if values else math.nan


def per_seed(runs: list[dict], until: int = 90) -> str:
    """Per cell, LR multiple and seed: ``final held-out / largest r up to step until / first jump's step``: whether
    a run's sharpness by the search's decision tells how it ends."""
    out = []
    for cell, cell_runs in _by_cell(runs):
        seeds = sorted({r["seed"] for r in cell_runs})
        out += [f"**{cell[0]} + {cell[1]}, per seed**: final held-out / largest r to step {until} / first jump", "",
                "| × good LR | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (1 + len(seeds)) + "|"]
        for mult in sorted({r["multiple"] for r in cell_runs}):
            cells = []
            for seed in seeds:
                run = next((r for r in cell_runs if r["multiple"] == mult and r["seed"] == seed), None)
                jump = None if run is None else first_jump(run["rows"])[0]
                cells.append("—" if run is None else
                             f"{run['final_test']:.3f} / {max_r(run['rows'], until):.2f} / {jump or '—'}")
            out.append(f"| {mult:g} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", default=["shapes_small:sgd", "tabular_small:sgd"],
                        help="WORKLOAD:OPTIMIZER, constant LR (the good LR from search_baselines.GOOD_LRS)")
    parser.add_argument("--multiples", nargs="+", type=float, default=list(MULTIPLES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=15)
    parser.add_argument("--batch", type=int, default=128, help="4 processes × 32, the untuned arm's batch")
    parser.add_argument("--sharp-items", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tol", type=float, default=1e-3)
    parser.add_argument("--switch", type=int, help="train at --switch-from x the good LR and move to each of "
                        "--multiples x it after this many steps (a vote's move) instead of training at the multiple "
                        "from the start")
    parser.add_argument("--switch-from", type=float, default=1.0, help="the multiple trained at before --switch")
    parser.add_argument("--out", default=NAME, help="results file name under benchmarks/results/")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of these results files instead")
    args = parser.parse_args(argv)
    if args.report:
        runs = [run for path in args.report for run in json.loads(Path(path).read_text())["runs"]]
        print(report(runs), per_seed(runs), trajectory(runs, "r"), trajectory(runs, "train"), sep="\n")
        return
    name, _ = begin(args.out, False)
    shared = ProbeArgs(args.steps, args.every, args.batch, args.sharp_items, args.iters, args.tol)
    runs = []
    for cell in args.cells:
        workload, optimizer = cell.split(":")
        good = GOOD_LRS[(optimizer, "constant")][workload]
        for seed in args.seeds:
            for mult in args.multiples:
                start = time.perf_counter()
                base = args.switch_from
                lr, switch = (good * base, (args.switch, mult / base)) if args.switch else (good * mult, None)
                run = {**probe_run(workload, optimizer, lr, seed, shared, switch), "multiple": mult, "good_lr": good,
                       "wall_s": time.perf_counter() - start}
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "rows"}), flush=True)
                write_json(name, {"args": vars(args), "runs": runs})
    print(write_json(name, {"args": vars(args), "runs": runs}))


if __name__ == "__main__":
    main()
