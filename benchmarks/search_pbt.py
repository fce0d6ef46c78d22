"""Population-based training for benchmark 2 with Ray Tune's own ``PopulationBasedTraining``.

Each member is a Ray Tune function trainable: it trains ``T`` steps at a time (a Lightning fit resumed from its
last checkpoint, as :func:`benchmarks.common.fit_run` does it), then reports its validation loss with a
checkpoint of weights and optimizer state. Ray's scheduler, at its defaults (quantile 0.25, ×1.2 / ×0.8,
resample probability 0.25) but in synchronous rounds (``synch=True``, so that every member spends exactly ``S``
steps; the asynchronous default restores a loser from whatever step its donor is at and re-trains), restarts a bottom-quantile member from a top member's checkpoint with a
perturbed LR. Ray runs in one long-lived child process (spawned, so the benchmark's own process never holds
Ray's threads and may fork HDET's workers); it is started once there (its start-up is counted in the first
arm's wall-clock and recorded as ``ray_init_s``) with one logical CPU per member process, so the members run
side by side as a grid's runs do.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import math
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from benchmarks.common import REPO, RunSpec, best_so_far, fit_run

_STATE: dict = {"ray_init_s": None, "executor": None}


def ray_available() -> bool:
    """Whether Ray Tune can be imported (it is in the ``bench`` extra, not the ``test`` one)."""
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.tune") is not None


def _start_ray(cpus: int) -> float:
    """Start Ray once in this process (workers import the repository through ``PYTHONPATH``); its seconds."""
    import ray

    if ray.is_initialized():
        return 0.0
    # Ray's workers are fresh interpreters: they must import `benchmarks` and this checkout of the package.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             configure_logging=False)
    _STATE["ray_init_s"] = time.perf_counter() - start
    return _STATE["ray_init_s"]


def _member(config: dict, base: RunSpec, interval: int, reports: str) -> None:
    """One PBT member (runs in a Ray worker): ``interval`` steps per report, resuming from Tune's checkpoint. Every
    report is also appended to ``reports/<trial id>.jsonl``: Ray's own per-trial table can lack a report of a
    member that was restarted from a donor (seen once on 2026-12-01), and the summary needs all of them."""
    from ray import tune

    log = Path(reports) / f"{tune.get_context().get_trial_id()}.jsonl"
    lr = config["lr"]
    work = Path(tempfile.mkdtemp(prefix="pbt_member"))
    step, ckpt_path = 0, None
    restored = tune.get_checkpoint()
    if restored is not None:
        local = Path(restored.to_directory(str(work / "restored")))
        step = json.loads((local / "step.json").read_text())["step"]
        ckpt_path = local / "model.ckpt"
    while step < base.steps:
        step += interval
        out = work / f"step{step}"
        out.mkdir()
        # A seed per round and LR: a restarted member does not replay its donor's data order.
        seed = base.seed + 1000 * (step // interval) + int(1e6 * lr) % 997
        spec = replace(base, lr=lr, steps=step, val_every=interval, seed=seed)
        run = fit_run(spec, work / "fit", ckpt_path=ckpt_path, save_ckpt=out / "model.ckpt")
        (out / "step.json").write_text(json.dumps({"step": step}))
        loss = run.final_val_loss if not run.diverged else math.inf
        metrics = {"val_loss": loss, "step": step, "lr": lr, "fit_s": run.fit_s, "wall_s": run.wall_s,
                   "diverged": int(run.diverged), "final_model_val_loss": run.final_model_val_loss}
        with log.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(out)))
        ckpt_path = out / "model.ckpt"


def run_pbt(lrs: list[float], lo: float, hi: float, interval: int, base: RunSpec, world: int, work: Path) -> dict:
    """Ray Tune PBT over ``len(lrs)`` members starting at ``lrs``, perturbing in ``[lo, hi]`` (log-uniform
    resampling); every member trains ``base.steps`` steps on ``base.devices`` processes. Runs in the Ray child."""
    if _STATE["executor"] is None:
        _STATE["executor"] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        atexit.register(_STATE["executor"].shutdown)
    return _STATE["executor"].submit(_run_pbt_here, lrs, lo, hi, interval, base, world, work).result()


def _run_pbt_here(lrs: list[float], lo: float, hi: float, interval: int, base: RunSpec, world: int, work: Path) -> dict:
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    start = time.perf_counter()
    init_s = _start_ray(world)
    scheduler = PopulationBasedTraining(
        time_attr="step", perturbation_interval=interval, hyperparam_mutations={"lr": tune.loguniform(lo, hi)},
        synch=True,  # rounds: a loser restarts from a donor at the same step, so every member spends S steps
    )
    reports = work / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    member = tune.with_parameters(_member, base=base, interval=interval, reports=str(reports.resolve()))
    tuner = tune.Tuner(
        tune.with_resources(member, {"cpu": base.devices}),
        param_space={"lr": tune.grid_search(list(lrs))},
        # Ray's own advice for PBT: a paused or exploited member continues in a live worker instead of a fresh
        # interpreter (without it, every round of every member re-imports torch and Lightning: most of the arm's
        # minutes on a 2-core machine). The numbers are unchanged; only start-ups go.
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", scheduler=scheduler, num_samples=1,
                                    reuse_actors=True),
        # Stopping at S keeps PBT from perturbing (and re-training) a member after its last step.
        run_config=tune.RunConfig(storage_path=str(work.resolve()), name="pbt", verbose=0, stop={"step": base.steps}),
    )
    tuner.fit()
    rows = [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(reports.glob("*.jsonl"))]
    return _summarise_members(rows, world, time.perf_counter() - start, init_s)


def _summarise_members(members: list[list[dict]], world: int, wall_s: float, init_s: float) -> dict:
    """Arm fields from every member's reports: the best member at each step, deployed seconds as synchronous
    rounds (the slowest member's fit per step), the settled LR of the member that ended best."""
    steps = sorted({int(row["step"]) for rows in members for row in rows})
    points, deployed = [], 0.0
    for step in steps:
        at = [row for rows in members for row in rows if int(row["step"]) == step]
        deployed += max(row["fit_s"] for row in at)
        points.append((world * step, min(row["val_loss"] for row in at), deployed))
    finals = [rows[-1] for rows in members if rows]
    best = min(finals, key=lambda row: row["val_loss"])
    history = [{"step": int(row["step"]), "lr": row["lr"], "val_loss": row["val_loss"]} for rows in members
               for row in rows]
    return dict(
        settled_lr=best["lr"], best_val_loss=min(p[1] for p in points), curve=best_so_far(points),
        lrs_tried=sorted({row["lr"] for row in history}), diverged_runs=sum(int(r["diverged"]) for m in members
                                                                            for r in m),
        wall_s=wall_s, extra={"history": history, "ray_init_s": init_s},
        # the member that ended best is the one handed back: its model's held-out loss (issue 59's tables)
        final_loss=best.get("final_model_val_loss", math.nan),
    )


# Ray Tune's PopulationBasedTraining defaults, for the minimal re-implementation below.
PBT_QUANTILE = 0.25
PBT_FACTORS = (1.2, 0.8)
PBT_RESAMPLE_P = 0.25


def pbt_explore(lr: float, lo: float, hi: float, rng: random.Random) -> float:
    """Ray's explore step for a continuous hyperparameter: resample from the range with probability
    0.25, otherwise multiply by 1.2 or 0.8."""
    if rng.random() < PBT_RESAMPLE_P:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return lr * rng.choice(PBT_FACTORS)


def run_pbt_minimal(
    lrs: list[float], lo: float, hi: float, interval: int, base: RunSpec, world: int, work: Path
) -> dict:
    """The synchronous exploit/explore loop of Ray's scheduler re-implemented in this process (no Ray): every
    ``interval`` steps the bottom quarter copy a random top-quarter member's checkpoint and perturb its LR.
    Kept because Ray costs minutes per arm on a loaded 2-core machine (docs/benchmarks.md has the numbers)."""
    rng = random.Random(base.seed)
    members = list(lrs)
    ckpts: list[Path | None] = [None] * len(members)
    n_swap = max(1, int(len(members) * PBT_QUANTILE))
    rows: list[list[dict]] = [[] for _ in members]
    start = time.perf_counter()
    for rnd, step in enumerate(range(interval, base.steps + 1, interval)):
        losses = []
        for m, lr in enumerate(members):
            spec = replace(base, lr=lr, steps=step, val_every=interval, seed=base.seed + 1000 * rnd + m)
            out = work / f"member{m}_round{rnd}.ckpt"
            run = fit_run(spec, work / f"member{m}", ckpt_path=ckpts[m], save_ckpt=out)
            ckpts[m] = out
            losses.append(run.final_val_loss if not run.diverged else math.inf)
            rows[m].append({"step": step, "lr": lr, "val_loss": losses[-1], "fit_s": run.fit_s,
                            "diverged": int(run.diverged), "final_model_val_loss": run.final_model_val_loss})
        if step + interval > base.steps:
            break
        order = sorted(range(len(members)), key=lambda m: losses[m])
        for loser in order[-n_swap:]:
            winner = rng.choice(order[:n_swap])
            ckpts[loser] = work / f"member{loser}_from{winner}_round{rnd}.ckpt"
            shutil.copyfile(ckpts[winner], ckpts[loser])
            members[loser] = pbt_explore(members[winner], lo, hi, rng)
    return _summarise_members(rows, world, time.perf_counter() - start, 0.0)
