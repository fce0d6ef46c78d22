"""Issue 42: does a run that loses a bad worker end where the same run without it would, on every path?

Three paths: async Local-SGD and DiLoCo in the Trainer (``AsyncLocalSGDStrategy``, ``devices=W``, forked ranks)
and the elastic mode (an ``OuterService`` and ``W`` one-device ``ElasticWorkerStrategy`` jobs, forked processes on
loopback), ``H`` inner steps per round, the package's defaults otherwise. Two tasks: ``boring``, Lightning's
``BoringModel`` with SGD lr 0.05 (the issue's case, ``tests/test_async_defaults.SGDBoring``; its loss's floor is 0),
and ``regression``, the tests' least squares (``tests/helpers.LinearModel``; a floor at its noise). In the faulty
run one of the ``W`` workers' loss is NaN from its step 2 on (its first round): it discards its rounds, is
rejected three times in a row and stops, having added nothing to the global model. Its fault-free counterpart
runs the ``W - 1`` healthy workers alone on the same budget, so both spend the same healthy samples. The two runs
cannot read the data in the same order (``W`` shards against ``W - 1``), so the fault-free run runs again with
only its data order changed (the sampler's seed; elastic: the workers' data seed): the table shows how far runs
land apart that differ in nothing but their order (and, async, timing). Reported per task, path and seed: the
global model's final loss ÷ its initial loss in both runs, faulty ÷ fault-free and reordered ÷ fault-free.

Run: ``python benchmarks/bad_worker_paths.py [--quick] [--workers W] [--budget B] [--seeds S] [--tasks ...]
[--paths ...]``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
from pathlib import Path
from tempfile import TemporaryDirectory

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.common import adaptive_rounds, add_output_args, begin, fmt, markdown_table, publish
from benchmarks.elastic import free_port
from lightning_hdet import AsyncLocalSGDStrategy, ElasticWorkerStrategy, OuterService
from tests.helpers import LinearModel, Regression
from tests.test_async_defaults import SGDBoring, _loss

NAME = "bad_worker_paths"
PATHS = ("async", "diloco", "elastic")
BAD_FROM = 2  # the bad worker's loss is NaN from its 2nd step on: within its first round, so none of it is applied
#: The reordered fault-free run's data seed is the run's seed plus this (its model starts the same).
REORDER = 1000
#: A "huge" bad worker's parameters move by this much at every step from :data:`HUGE_FROM` on: finite pushes
#: thousands of times the others', which only the outer side's norm check can catch; it needs 4 accepted pushes
#: first, so the fault starts in the worker's 4th round (H = 8).
HUGE_STEP, HUGE_FROM = 100.0, 26
FAULTS = ("nan", "huge")
FAULT_TEXT = {"nan": f"its loss NaN from its step {BAD_FROM}",
              "huge": f"its parameters moved by {HUGE_STEP:g} at every step from its step {HUGE_FROM}"}


class Faulty:
    """A mixin: on rank ``bad_rank`` (``None``: healthy), ``"nan"`` makes the loss NaN from step :data:`BAD_FROM`
    on and ``"huge"`` moves every parameter by :data:`HUGE_STEP` at each step from :data:`HUGE_FROM` on."""

    def __init__(self, bad_rank: int | None = None, fault: str = "nan") -> None:
        super().__init__()
        self.bad_rank, self.fault = bad_rank, fault

    def faulty(self, loss: torch.Tensor) -> torch.Tensor:
        if self.global_rank != self.bad_rank:
            return loss
        step = self.trainer.global_step
        if self.fault == "huge" and step >= HUGE_FROM:
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(HUGE_STEP)
        return loss * math.nan if self.fault == "nan" and step >= BAD_FROM else loss


class BadBoring(Faulty, SGDBoring):
    """``SGDBoring`` with a :class:`Faulty` rank."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {**out, "loss": self.faulty(out["loss"])}


class BadLinear(Faulty, LinearModel):
    """The tests' least squares (8 features, noise std 0.01, 256 samples, SGD lr 0.05, batch 16) with a
    :class:`Faulty` rank."""

    def training_step(self, batch, batch_idx):
        return self.faulty(super().training_step(batch, batch_idx))


def regression_loss(model: torch.nn.Module) -> float:
    """The least squares' loss on its 256 training samples: its floor is the noise's, about 1e-4."""
    data = Regression(n=256, seed=0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model.layer(data.x), data.y))


#: Each task's model (taking the bad rank) and the loss the table reports.
TASKS = {"boring": (BadBoring, _loss), "regression": (BadLinear, regression_loss)}


class Curve(Callback):
    """Rank 0 records the global model's ``loss`` every ``every`` inner steps applied, and at the end."""

    def __init__(self, out: Path, every: int, loss) -> None:
        self.out, self.every, self.loss, self.curve = out, every, loss, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        outer = trainer.strategy._outer
        if outer is not None and outer.steps_done >= self.every * (len(self.curve) + 1):
            copy = type(pl_module)()
            torch.nn.utils.vector_to_parameters(outer.global_model()[0], copy.parameters())
            self.curve.append((outer.steps_done, self.loss(copy)))

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            outer = trainer.strategy._outer
            self.out.write_text(json.dumps({
                "final": self.loss(pl_module), "curve": self.curve, "steps_done": outer.steps_done,
                "workers": {str(w): vars(s) for w, s in outer.workers.items()}}))


def fit_trainer(mode: str, workers: int, budget: int, seed: int, fault: str | None, work: Path, every: int = 0,
                task: str = "boring", order: int = 0, **strategy) -> dict:
    """One Trainer run of ``workers`` ranks sharing ``budget`` inner steps (``mode``: ``"async"`` or ``"sync"``);
    with a ``fault`` (:class:`Faulty`), the last rank goes bad; ``order`` is added to the sampler's seed (only the
    data order changes). Returns the initial and final loss, the curve (every ``every`` steps applied), the steps
    applied and each worker's statistics."""
    if budget % workers:
        raise ValueError(f"`budget` must be a multiple of the {workers} workers, got {budget}")
    work.mkdir(parents=True, exist_ok=True)
    make, loss = TASKS[task]
    seed_everything(seed)
    model = make(workers - 1 if fault else None, fault or "nan")
    initial = loss(model)
    os.environ["PL_GLOBAL_SEED"] = str(seed + order)  # Lightning's DistributedSampler reads its seed from here
    out = work / "record.json"
    Trainer(strategy=AsyncLocalSGDStrategy(mode=mode, start_method="fork", **strategy), accelerator="cpu",
            devices=workers, max_steps=budget // workers, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=work,
            callbacks=[Curve(out, every or budget, loss)]).fit(model)
    return {"initial": initial, **json.loads(out.read_text())}


def _serve(address: str, budget: int, seed: int, every: int, out: Path, task: str, settings: dict) -> None:
    make, loss = TASKS[task]
    seed_everything(seed)
    model = make()
    initial = loss(model)
    service = OuterService(model, address, budget, evaluate=lambda m: {"loss": loss(m)}, evaluate_every=every,
                           lease_s=30.0, **settings)
    service.run()
    status = service.status()
    curve = [(updates, metrics["loss"]) for updates, metrics in status.pop("evaluations")]
    out.write_text(json.dumps({"initial": initial, "final": loss(model), "curve": curve, **status}))


def _work(address: str, seed: int, fault: str | None, out: Path, task: str) -> None:  # seed: of its data order
    strategy = ElasticWorkerStrategy(address, seed=seed, heartbeat_s=0.5)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_epochs=-1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TASKS[task][0](0 if fault else None, fault or "nan"))
    out.write_text(json.dumps({"sessions": strategy.sessions, "inner_steps": strategy.inner_steps}))


def fit_elastic(workers: int, budget: int, seed: int, fault: str | None, work: Path, every: int = 0, task: str = "boring",
                timeout: float = 300, order: int = 0, **settings) -> dict:
    """One elastic run: a service and ``workers`` one-device worker jobs, forked, on loopback; with a ``fault``,
    the last worker goes bad; ``order`` is added to the workers' data seed. ``every``: the service evaluates the global model every so many outer updates (0:
    at the end only). Returns the service's record (``initial``, ``final``, ``curve``, its status) and
    ``exit_codes`` (the workers', then the service's)."""
    work.mkdir(parents=True, exist_ok=True)
    fork = multiprocessing.get_context("fork")
    address, record = f"127.0.0.1:{free_port()}", work / "service.json"
    procs = [fork.Process(target=_serve, args=(address, budget, seed, every, record, task, settings))]
    procs += [fork.Process(target=_work, args=(address, seed + order, fault if i == workers - 1 else None,
                                               work / f"w{i}.json", task))
              for i in range(workers)]
    for p in procs:
        p.start()
    try:
        for p in (*procs[1:], procs[0]):
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    codes = [p.exitcode for p in (*procs[1:], procs[0])]
    return {**(json.loads(record.read_text()) if record.exists() else {}), "exit_codes": codes}


def run_set(path: str, task: str, workers: int, budget: int, seed: int, work: Path, fault: str = "nan",
            **settings) -> dict:
    """The faulty run (``workers``, the last one bad), its fault-free counterpart (the healthy ones alone) and that
    counterpart with another data order (how far runs land apart that differ only in their order)."""
    runs = []
    for bad, w, order in ((fault, workers, 0), (None, workers - 1, 0), (None, workers - 1, REORDER)):
        where = work / f"{task}_{path}_{seed}_{len(runs)}"
        if path == "elastic":
            runs.append(fit_elastic(w, budget, seed, bad, where, task=task, order=order, **settings))
        else:
            runs.append(fit_trainer("sync" if path == "diloco" else "async", w, budget, seed, bad, where, task=task,
                                    order=order, **settings))
    faulty, clean, reordered = runs
    return {"task": task, "path": path, "seed": seed, "initial": clean["initial"], "faulty": faulty["final"],
            "clean": clean["final"], "reordered": reordered["final"], "ratio": faulty["final"] / clean["final"],
            "noise": reordered["final"] / clean["final"], "steps": [r["steps_done"] for r in runs],
            "rejected": sum(s["rejected"] for s in faulty["workers"].values())}


def table(runs: list[dict], args: argparse.Namespace) -> str:
    rows = []
    for task in args.tasks:
        for path in args.paths:
            sel = [r for r in runs if (r["task"], r["path"]) == (task, path)]
            cells = [", ".join(fmt(r[key] / r["initial"], ".2g") for r in sel) for key in ("clean", "faulty")]
            rows.append([task, path, *cells, ", ".join(fmt(r["ratio"]) for r in sel),
                         f"**{fmt(statistics.median(r['ratio'] for r in sel))}**",
                         ", ".join(fmt(r["noise"]) for r in sel), ", ".join(str(r["rejected"]) for r in sel)])
    head = (f"Mode: {'quick' if args.quick else 'full'}; H = {args.local_steps}, budget {args.budget} inner steps; "
            f"faulty: {args.workers} workers, the last one bad ({FAULT_TEXT[args.fault]}); fault-free: the "
            f"{args.workers - 1} healthy ones alone, and again with another data order (*reordered ÷*: runs that differ "
            "only in the sampler's or the workers' data seed); the "
            f"defaults otherwise (outer `{args.outer}`). `boring`: BoringModel + SGD lr 0.05, loss on 256 held-out "
            "inputs (its floor is 0); `regression`: the tests' least squares, SGD lr 0.05, batch 16, loss on its "
            "256 samples (its floor is the noise's, ~1e-4 × the start). Per seed.\n\n")
    return head + markdown_table(["task", "path", "fault-free ÷ initial", "faulty ÷ initial", "faulty ÷ fault-free",
                                  "median ÷", "reordered ÷ fault-free", "pushes rejected"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="workers of the faulty run, the bad one included")
    p.add_argument("--budget", type=int, default=None, help="inner steps in all (default 960; --quick 96)")
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--outer", default="stable", help="the outer preset (default: the package's)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--fault", default="nan", choices=FAULTS, help="how the bad worker goes bad (see Faulty; "
                   "'huge' from its 4th round: its first rounds are applied, so the healthy samples differ a little)")
    p.add_argument("--seeds", type=int, default=None, help="seeds (default 3; --quick 1)")
    p.add_argument("--first-seed", type=int, default=0)
    add_output_args(p)
    args = p.parse_args(argv)
    args.budget = args.budget or (96 if args.quick else 960)
    args.seeds = args.seeds or (1 if args.quick else 3)
    name, _ = begin(NAME, args.quick)
    runs = []
    with TemporaryDirectory(prefix=name) as tmp:
        for task in args.tasks:
            for path in args.paths:
                for seed in range(args.first_seed, args.first_seed + args.seeds):
                    runs.append(run_set(path, task, args.workers, args.budget, seed, Path(tmp), args.fault,
                                        local_steps=adaptive_rounds(args.local_steps, "sync" if path == "diloco" else "async"),
                                        outer=args.outer))
                    print(runs[-1], flush=True)
    publish(name, args, {"runs": runs}, table(runs, args))


if __name__ == "__main__":
    main()
