"""Benchmark 2, the claim tested: finding the learning rate at equal total compute, on three workloads.

A job has ``W`` processes and ``G`` groups; every method gets ``W × S`` rank-steps:

- **untuned**: what a user does without any tuning, the price check of insurance: plain DDP at the starting LR
  on all ``W`` processes for ``S`` steps (as one process on the whole job's batch: the same samples);
- **grid search**: the ``G`` LRs of the grid, one run each on ``W/G`` processes for ``S`` steps
  (deployed side by side, so its wall-clock is that of the slowest run);
- **Optuna TPE**: ``G`` trials one after another, each on ``W/G`` processes for ``S`` steps, searching
  log-uniformly over the grid's range; the first trial is the starting LR;
- **population-based training**: Ray Tune's own ``PopulationBasedTraining`` with its defaults (quantile
  0.25, perturbation ×1.2 / ×0.8, resample probability 0.25, asynchronous): ``G`` members start at the
  grid's LRs on ``W/G`` processes each and report (and checkpoint) every ``T`` steps, which is also the
  perturbation interval; an exploited member restarts from the donor's checkpoint (weights and optimizer);
- **PBT, minimal** (``pbt_minimal``, not run by default): the same synchronous loop re-implemented without
  Ray, for machines where Ray's start-up and per-trial processes cost more than the training;
- **Prodigy** (``lr=1``, its own step-size estimate) and **schedule-free AdamW** (at the start LR): what a
  user would pick instead of tuning, one run each of ``S`` steps on the whole job's batch (``W`` × the
  per-process batch in one process: the same samples as DDP on ``W`` processes, without its start-up);
- **HDET at its defaults** (``--hdet-votes defaults``): what a user gets from ``strategy="hdet"`` with nothing
  else given, one run on ``W`` processes at the starting LR: the groups, their multipliers (the start among them)
  and the vote interval are the package's, derived from the job (``--groups`` and ``--pbt-interval`` do not apply);
  ``defaults:OPTION=VALUE[:...]`` changes one option of ``HDETStrategy`` (``num_groups``, ``gradient_sync``) or of
  ``Search`` (e.g. ``defaults:refine_spread=1.0``), to measure it beside the defaults;
- **HDET**, one arm per other entry of ``--hdet-votes`` (``VOTE[:SIGNAL][@SYNC]``, e.g. ``pbt@global``): one run
  on ``W`` processes in ``G`` groups (each its own DDP job on ``W/G`` processes) at the grid's LRs, voting and
  blending every ``T`` steps (``blend="best"`` by default). Entries the installed ``HDETCallback`` does not
  accept are reported as skipped, so new rules are measured as soon as they land;
- **lr_find** (issue 59, not run by default): Lightning's ``Tuner(trainer).lr_find`` (``num_training=100``, its
  other arguments at their defaults) on one process at the per-process batch from the starting LR's model, then
  plain DDP at its suggestion for ``S - ceil(100/W)`` steps (the finder's 100 rank-steps counted;
  ``benchmarks/search_lr_find.py``); when it suggests nothing, the starting LR, recorded;
- optionally (``--full-grid``) **grid ×G**: the grid again with every run as large as the whole HDET job
  (``W``-process batch), i.e. ``G`` × the compute: the ceiling, the reference of the "one run over G LRs at 1/G
  of the grid's compute" target.

The targets table reports HDET ÷ untuned and HDET ÷ grid ×G per start (issue 28's price check).

Each method starts from a good LR, 10× too high and 10× too low (the grid is centred on the start); ``--starts``
adds 40× either way (issue 59). ``--optimizer sgd`` (momentum 0.9) and ``--schedule cosine`` (``CosineAnnealingLR``
over the run, in the model's ``configure_optimizers``) apply to every run; the good LR of each workload, optimizer
and schedule is measured (``GOOD_LRS``, ``benchmarks/search_calibrate.py``) or given (``--good-lr``). Every arm also
records the held-out loss of the model it hands back (``Arm.final_loss``): issue 59's targets table
(``search_report.handed_back_table``) reads it.
``--init-nudge K`` starts every arm of a seed from the same weights moved by one ULP (``common.nudge_weights``):
what a change in the last bits of the arithmetic moves each arm's loss by, the resolution of a cell.
Reported per workload, start and method (medians over seeds, with the range over seeds): best validation
loss, the LR it settled on, compute and deployed wall-clock to a target loss; then the targets of issue 13
as ratios, HDET against every baseline.

Run: ``python benchmarks/search_baselines.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    hdet_callbacks,
    DOCS_DIR,
    RESULTS_DIR,
    ALL_WORKLOADS,
    WORKLOADS,
    RunResult,
    RunSpec,
    begin,
    block_page,
    best_so_far,
    fit_run,
    plot_panels,
    stamp,
    write_block,
    write_json,
)
from benchmarks.search_lr_find import FINDER_STEPS, run_lr_find
from benchmarks.search_pbt import ray_available, run_pbt, run_pbt_minimal
from benchmarks.search_report import page_table, summarise, tables
from lightning_hdet.hdet.multipliers import centred_grid
from lightning_hdet.hdet.rules.defaults import SEARCH_FRACTION

NAME = "search_baselines"
DEFAULTS = "defaults"  # the HDET arm with nothing given: the package's groups, multipliers and vote interval
STARTS = {"good": 1.0, "10x high": 10.0, "10x low": 0.1, "40x high": 40.0, "40x low": 1 / 40}
DEFAULT_STARTS = ("good", "10x high", "10x low")  # the 40x starts (issue 59) run when named
BASELINES = ("untuned", "grid", "optuna_tpe", "pbt", "pbt_minimal", "prodigy", "schedulefree", "lr_find")
# The good AdamW LR of each workload: the best of a coarse sweep (char LM: best grid LR of a first run at
# S = 400; shapes: 1e-3..1e-2 within 0.06 nats of each other at S = 320, 3e-2 and above collapse to chance).
# tabular: 3e-3..1e-2 within 0.02 of each other at 300 steps of batch 256, 0.3 and above at the labels' prior.
GOOD_LR = {"char_lm": 1e-2, "shapes": 5e-3, "tabular": 3e-3}
# Issue 59's repeating workloads (constant LR, W = 4 x batch 32, S = 300): the LR of the lowest median held-out loss
# of the handed-back model over seeds 0-2, on a grid of three LRs per decade (benchmarks/search_calibrate.py, results
# in benchmarks/results/search_calibrate*.json). tabular_small: AdamW 4.6e-4 (1.239; 2.2e-4 and 1e-3 within 0.07),
# SGD 1e-2 (1.238; 4.6e-3 and 2.2e-2 within 0.07); both memorise above (AdamW 1e-2: 3.10). shapes_small: AdamW
# 2.2e-3 (0.914; 1e-3 and 4.6e-3 within 0.06, seeds spread up to 0.25), SGD 4.6e-2 (0.920; 0.1: 1.023, 2.2e-2:
# 1.207; 1e-4 to 2.2e-3 barely learn, 1.79-1.80).
GOOD_LR.update({"tabular_small": 4.6e-4, "shapes_small": 2.2e-3})
GOOD_LR_SGD = {"tabular_small": 1e-2, "shapes_small": 4.6e-2}
# With --schedule cosine (the same calibration, search_calibrate_*_cosine_*): tabular_small AdamW 1e-3 (1.240;
# 4.6e-4: 1.255, 2.2e-3: 1.293), SGD 2.2e-2 (1.234; 1e-2: 1.277, 4.6e-2: 1.298); shapes_small (four LRs around the
# constant's best) AdamW 2.2e-3 (0.971; 4.6e-3 to 1e-2 within 0.02), SGD 0.1 (0.868; 4.6e-2: 1.052, 0.215: 1.146).
GOOD_LR_COSINE = {"tabular_small": 1e-3, "shapes_small": 2.2e-3}
GOOD_LR_SGD_COSINE = {"tabular_small": 2.2e-2, "shapes_small": 0.1}
# Where a workload x optimizer x schedule has no measured good LR: --good-lr gives it (search_calibrate.py finds it).
GOOD_LRS = {("adamw", "constant"): GOOD_LR, ("sgd", "constant"): GOOD_LR_SGD, ("adamw", "cosine"): GOOD_LR_COSINE,
            ("sgd", "cosine"): GOOD_LR_SGD_COSINE}


@dataclass
class Arm:
    """One method from one start on one seed of one workload: ``curve`` rows are ``(rank_steps, best val loss
    so far, deployed seconds)``; ``wall_s`` is what it took on this machine."""

    workload: str
    method: str
    start: str
    seed: int
    settled_lr: float
    best_val_loss: float
    curve: list[tuple[int, float, float]]
    lrs_tried: list[float]
    diverged_runs: int
    wall_s: float
    extra: dict = field(default_factory=dict)
    final_loss: float = math.nan  # held-out loss of the handed-back model (grid: of its best run's); NaN: not measured


def lr_grid(center: float, groups: int, spread: float) -> list[float]:
    """``groups`` LRs spaced by a factor ``spread``, geometrically centred on ``center``."""
    return centred_grid([center], groups, spread)[:, 0].tolist()


def _side_by_side(runs: list[RunResult], scale: int) -> list[tuple[int, float, float]]:
    """Curve of runs deployed side by side: at each validated step, ``scale × step`` rank-steps, the best loss
    of any run and the slowest run's seconds."""
    points = []
    for step in sorted({s for r in runs for s, _, _ in r.val_curve}):
        rows = [row for r in runs for row in r.val_curve if row[0] == step]
        points.append((scale * step, min(row[1] for row in rows), max(row[2] for row in rows)))
    return best_so_far(points)


def run_grid(method: str, lrs: list[float], base: RunSpec, world: int, work: Path) -> dict:
    """The grid: one run per LR of ``base`` (``grid``: W/G processes each; ``grid_xG``: the whole job's batch)."""
    runs = [fit_run(replace(base, lr=lr), work / f"grid{g}") for g, lr in enumerate(lrs)]
    best = min(runs, key=lambda r: r.best_val_loss)
    scale = world * len(lrs) if method == "grid_xG" else world
    return dict(settled_lr=best.spec.lr, best_val_loss=best.best_val_loss, curve=_side_by_side(runs, scale),
                lrs_tried=lrs, diverged_runs=sum(r.diverged for r in runs), wall_s=sum(r.wall_s for r in runs),
                final_loss=min(r.final_model_val_loss for r in runs))


def run_optuna(start_lr: float, lo: float, hi: float, trials: int, base: RunSpec, work: Path) -> dict:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=base.seed, n_startup_trials=1)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial({"lr": start_lr})
    runs: list[RunResult] = []

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", lo, hi, log=True)
        runs.append(fit_run(replace(base, lr=lr), work / f"trial{trial.number}"))
        return runs[-1].best_val_loss

    study.optimize(objective, n_trials=trials)
    points, spent_steps, spent_s = [], 0, 0.0
    for r in runs:
        points += [(base.devices * (spent_steps + s), loss, spent_s + secs) for s, loss, secs in r.val_curve]
        spent_steps += r.spec.steps
        spent_s += r.fit_s
    best = min(runs, key=lambda r: r.best_val_loss)  # the trial the study hands back (its objective)
    return dict(settled_lr=best.spec.lr, best_val_loss=best.best_val_loss, curve=best_so_far(points),
                lrs_tried=[r.spec.lr for r in runs], diverged_runs=sum(r.diverged for r in runs),
                wall_s=sum(r.wall_s for r in runs), final_loss=best.final_model_val_loss)


def whole_batch(base: RunSpec, world: int) -> RunSpec:
    """``base`` as one process on the whole job's batch (``world`` × the per-process batch), validated on the same
    samples as the per-process runs: ``val_batches / world`` batches of ``world`` × the size (the validation
    stream is not shuffled). Without it the whole-batch arms validated on ``world`` × more samples than the others,
    a different number (e.g. 1.09 against 1.19 for one tabular model) compared as if it were the same."""
    return replace(base, devices=1, batch_size=base.batch_size * world, val_batches=base.val_batches // world)


def run_single(optimizer: str, lr: float, base: RunSpec, world: int, work: Path) -> dict:
    """One run of a self-tuning optimizer on the whole job's batch for ``S`` steps (``W × S`` rank-steps)."""
    spec = replace(whole_batch(base, world), lr=lr, model={**base.model, "optimizer": optimizer})
    run = fit_run(spec, work)
    return dict(settled_lr=run.rank_lrs[0], best_val_loss=run.best_val_loss, curve=_side_by_side([run], world),
                lrs_tried=[lr], diverged_runs=int(run.diverged), wall_s=run.wall_s, final_loss=run.final_model_val_loss)


class HDETArm(NamedTuple):
    vote: str
    signal: str
    sync: str
    search: bool  # ``+search``: the callback ends the search (``--search-fraction``) and trains globally


ARM_SUFFIXES = ("search",)


def parse_hdet_arm(entry: str, sync: str = "group") -> HDETArm:
    """``"pbt:mean@global"`` -> ``("pbt", "mean", "global", False)``: the vote, its signal (default ``mean``), the
    strategy's ``gradient_sync`` (default ``sync``); the suffix ``+search`` is one fit of the search-then-train recipe
    (``HDETCallback(search=Search())``)."""
    head, *suffixes = entry.split("+")
    unknown = [s for s in suffixes if s not in ARM_SUFFIXES]
    if unknown:
        raise ValueError(f"HDET arm {entry!r}: suffixes are {['+' + s for s in ARM_SUFFIXES]}, got '+{unknown[0]}'.")
    rule, _, named = head.partition("@")
    vote, _, signal = rule.partition(":")
    return HDETArm(vote, signal or "mean", named or sync, "search" in suffixes)


def accepted_votes(votes: list[str], sync: str = "group") -> tuple[list[str], dict[str, str]]:
    """The ``VOTE[:SIGNAL][@SYNC]`` entries (or two-step ``FIRST>SECOND``) the installed package accepts, and why
    each other one is skipped (``sync``: the gradient sync of an entry that names none; e.g. ``trust_region``
    needs ``global``)."""
    from lightning_hdet import HDETStrategy

    ok, skipped = [], {}
    for vote in votes:
        if is_defaults_arm(vote):
            try:
                defaults_options(vote)
            except (ValueError, TypeError) as err:
                skipped[vote] = str(err)
            else:
                ok.append(vote)
            continue
        try:
            for step in vote.split(">"):
                arm = parse_hdet_arm(step, sync)
                callback = hdet_callbacks(2, vote=arm.vote, signal=arm.signal, search_steps=2 if arm.search else None)[0]
                callback.settings.vote.check_strategy(HDETStrategy(num_groups=2, gradient_sync=arm.sync).gradient_sync, [])
        except (ValueError, TypeError) as err:
            skipped[vote] = str(err)
        else:
            ok.append(vote)
    return ok, skipped


def run_hdet_arm(lrs: list[float], base: RunSpec, world: int, groups: int, interval: int, vote: str, blend: str,
                 start_method: str, work: Path, init_weights: Path | None = None,
                 save_weights: Path | None = None, refine_spread: float = 1.5,
                 search_fraction: float = SEARCH_FRACTION) -> dict:
    """HDET: one run of ``base.steps`` steps on ``world`` processes in ``groups`` groups starting at ``lrs``.

    ``@group`` (default): each group is its own DDP job on ``world / groups`` processes; with one
    process per group the data is not sharded, so a group reads the whole training stream as the matching
    grid run does (shuffled in its own order). ``@global`` (published, the strategy's default): every rank
    reads its own shard of the training stream and each step's gradient is averaged over all ranks, so every
    group steps on the whole job's batch, at its own LR. Either way every rank validates on the same first
    batches. Every ``interval`` steps the groups vote on their interval training loss (or ``vote``'s signal) and
    blend. The best-so-far curve takes, at each validation, the best group (each group's first rank), as the grid
    takes the best of its runs. ``+search``: one fit of the search-then-train recipe, the callback ending the
    search at ``search_fraction`` of the steps (default ``Search()``'s, a quarter; LRs then a grid of ratio
    ``refine_spread`` around the winner's, ``global`` sync);
    every rank reads its own shard throughout.
    """
    from lightning_hdet import HDETStrategy

    center = math.exp(sum(map(math.log, lrs)) / len(lrs))
    if is_defaults_arm(vote):
        return run_hdet_defaults(center, base, world, start_method, work, vote)
    arm = parse_hdet_arm(vote)
    strategy = HDETStrategy(
        num_groups=groups, lr_multipliers=[lr / center for lr in lrs], gradient_sync=arm.sync,
        start_method=start_method, process_group_backend="gloo",
    )
    callbacks = hdet_callbacks(interval, vote=arm.vote, signal=arm.signal, blend=blend, seed=base.seed,
                               search_steps=int(base.steps * search_fraction) if arm.search else None,
                               refine_spread=refine_spread)
    shared = arm.sync == "global" or arm.search
    spec = replace(base, lr=center, devices=world, shard_data=world > groups and not shared, shard_train=shared)
    run = fit_run(spec, work, strategy=strategy, callbacks=callbacks, init_weights=init_weights,
                  save_weights=save_weights)
    return hdet_outcome(run, world, groups, lrs)


STRATEGY_OPTIONS = ("num_groups", "gradient_sync", "lr_multipliers")  # a defaults arm's HDETStrategy options


def is_defaults_arm(vote: str) -> bool:
    """``defaults`` or ``defaults:OPTION=VALUE[:...]`` (:func:`defaults_options`)."""
    return vote.split(":")[0] == DEFAULTS


def defaults_options(vote: str) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """A ``defaults[:OPTION=VALUE...]`` arm's ``HDETStrategy`` keyword arguments, ``Search`` and ``HDETCallback``
    keyword arguments: the defaults with those options changed (e.g. ``defaults:refine_spread=1.0``,
    ``defaults:num_groups=2``, ``defaults:gradient_sync=cluster:vote=halving`` or
    ``defaults:lr_multipliers=0.44/1/1/5.2``, to measure one option)."""
    from lightning_hdet import Search
    from lightning_hdet.experimental import Halving
    from lightning_hdet.hdet.rules.options import as_vote

    options = {k: _value(v) for k, v in (item.split("=", 1) for item in vote.split(":")[1:])}
    strategy = {k: options.pop(k) for k in STRATEGY_OPTIONS if k in options}
    if "lr_multipliers" in strategy:  # one per group, separated by "/"
        strategy["lr_multipliers"] = [float(m) for m in str(strategy["lr_multipliers"]).split("/")]
    callback = {"vote": Halving() if options["vote"] == "halving" else as_vote(options["vote"])} if "vote" in options else {}
    options.pop("vote", None)
    return strategy, Search(**options), callback


def _value(text: str) -> Any:
    """An option's value as written: an integer, a number, else the word (``gradient_sync=cluster``)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def defaults_run(entry: str, start_method: str, seed: int) -> tuple[Any, list[Any]]:
    """The strategy and callbacks of a ``defaults[:OPTION=VALUE...]`` arm: ``HDETStrategy()`` and ``HDETCallback()``
    with only the seed and those options given (:func:`defaults_options`)."""
    from lightning_hdet import HDETCallback, HDETStrategy

    options, search, callback = defaults_options(entry)
    strategy = HDETStrategy(start_method=start_method, process_group_backend="gloo", **options)
    return strategy, [HDETCallback(seed=seed, search=search, **callback)]


def run_hdet_defaults(lr: float, base: RunSpec, world: int, start_method: str, work: Path,
                      entry: str = "defaults") -> dict:
    """``strategy="hdet"`` as a user launches it: ``HDETStrategy()`` and ``HDETCallback()`` with nothing given
    (only the seed of its random choices; an ``entry`` ``defaults:OPTION=VALUE...`` changes those options,
    :func:`defaults_run`), the optimizer at the starting LR ``lr``, every rank reading its own shard (the default
    search ends with one gradient over the job)."""
    strategy, callbacks = defaults_run(entry, start_method, base.seed)
    spec = replace(base, lr=lr, devices=world, shard_data=False, shard_train=True)
    run = fit_run(spec, work, strategy=strategy, callbacks=callbacks)
    groups = len(run.rank_extra[0]["group_lrs"])
    return hdet_outcome(run, world, groups, [lr])


def hdet_outcome(run: RunResult, world: int, groups: int, lrs: list[float]) -> dict:
    """One HDET run's row: the best group's LR, the best-so-far curve over the groups' first ranks (as the grid
    takes the best of its runs), every LR tried (``lrs``: those it started from), the vote history."""
    heads = [g * (world // groups) for g in range(groups)]
    head_runs = [replace(run, rank_val_curves=[run.rank_val_curves[h]]) for h in heads]
    final = {g: r.final_val_loss for g, r in enumerate(head_runs)}
    best_group = min(final, key=lambda g: final[g] if math.isfinite(final[g]) else math.inf)
    curve = _side_by_side(head_runs, world)
    history = run.rank_extra[0]["history"]
    return dict(
        settled_lr=run.rank_extra[0]["group_lrs"][best_group], best_val_loss=curve[-1][1] if curve else math.inf,
        curve=curve, lrs_tried=sorted({row["lr"] for row in history} | set(lrs)), diverged_runs=int(run.diverged),
        wall_s=run.wall_s, final_loss=run.final_model_val_loss,
        extra={"history": history, "rescues": run.rank_extra[0]["rescues"],
               "merged_model_val_loss": run.final_model_val_loss},
    )


def run_two_step(lrs: list[float], base: RunSpec, args: argparse.Namespace, entry: str, work: Path) -> dict:
    """``FIRST>SECOND``: HDET arm ``FIRST`` over the grid's LRs for half the steps, then arm ``SECOND`` for the
    other half from its final (merged) model, its LRs a grid of factor ``--two-step-spread`` around the LR the
    first half settled on (a fresh optimizer, the next shuffle of the data). Same total compute as any arm."""
    first, second = entry.split(">")
    half = replace(base, steps=base.steps // 2)
    weights = work / "first.pt"
    one = run_hdet_arm(lrs, half, args.world_size, args.groups, args.pbt_interval, first, args.hdet_blend,
                       args.start_method, work / "first", save_weights=weights)
    near = lr_grid(one["settled_lr"], args.groups, args.two_step_spread)
    two = run_hdet_arm(near, replace(half, seed=base.seed + 1000), args.world_size, args.groups, args.pbt_interval,
                       second, args.hdet_blend, args.start_method, work / "second", init_weights=weights)
    done_steps, done_s = args.world_size * half.steps, max((s for _, _, s in one["curve"]), default=0.0)
    later = [(done_steps + c, loss, done_s + secs) for c, loss, secs in two["curve"]]
    return dict(settled_lr=two["settled_lr"], best_val_loss=min(one["best_val_loss"], two["best_val_loss"]),
                curve=best_so_far(one["curve"] + later), lrs_tried=sorted(set(one["lrs_tried"] + two["lrs_tried"])),
                diverged_runs=one["diverged_runs"] + two["diverged_runs"], wall_s=one["wall_s"] + two["wall_s"],
                final_loss=two["final_loss"],
                extra={"history": one["extra"]["history"] + [{**row, "step": row["step"] + half.steps}
                                                             for row in two["extra"]["history"]], "first_settled_lr":
                       one["settled_lr"], "merged_model_val_loss": two["extra"]["merged_model_val_loss"]})


def base_spec(args: argparse.Namespace, workload: str, center: float, seed: int) -> RunSpec:
    """A grid run of ``workload``: W/G processes, the script's sizes."""
    sizes = {"char_lm": {"d_model": args.d_model, "n_layers": args.n_layers}, "shapes": {"width": args.width}}
    sizes["shapes_small"] = sizes["shapes"]
    model = dict(sizes.get(workload, {}))  # tabular: the MLP's own sizes
    model["optimizer"] = args.optimizer
    if workload != "char_lm":  # the char LM's own "cosine" has a floor; fill_defaults refuses it there
        model["scheduler"] = args.schedule
    return RunSpec(
        lr=center, steps=args.steps, seed=seed, devices=args.world_size // args.groups, batch_size=args.batch_size,
        max_chars=args.max_chars, val_every=args.val_every, val_batches=args.val_batches, model=model,
        workload=workload, init_nudge=args.init_nudge,
    )


_FINDER_ARMS: dict[str, dict] = {}


def finder_arm(start_lr: float, base: RunSpec, world: int, work: Path) -> dict:
    """The lr_find arm, run once per workload, seed and settings: the finder sweeps its own range (1e-8 to 1) from
    the same seeded weights and data order whatever the starting LR, so its suggestion, and the DDP run at it, are
    the same from every start (only a ``None`` suggestion falls back to the start; then it runs again)."""
    key = repr(replace(base, lr=0.0)) + f"/{world}"
    if key not in _FINDER_ARMS or _FINDER_ARMS[key]["extra"]["fallback"]:
        _FINDER_ARMS[key] = run_lr_find(start_lr, base, world, work)
    return _FINDER_ARMS[key]


def run_start(workload: str, start: str, args: argparse.Namespace, seed: int, work: Path) -> list[Arm]:
    """Every method from one start on one seed."""
    center = args.good_lr[workload] * STARTS[start]
    base = base_spec(args, workload, center, seed)
    lrs = lr_grid(center, args.groups, args.lr_spread)
    lo, hi, world = lrs[0], lrs[-1], args.world_size
    jobs = {
        "untuned": lambda: run_single(args.optimizer, center, base, world, work / "untuned"),
        "grid": lambda: run_grid("grid", lrs, base, world, work / "grid"),
        "optuna_tpe": lambda: run_optuna(center, lo, hi, args.groups, base, work / "optuna"),
        "pbt": lambda: run_pbt(lrs, lo, hi, args.pbt_interval, base, world, work / "pbt"),
        "pbt_minimal": lambda: run_pbt_minimal(lrs, lo, hi, args.pbt_interval, base, world, work / "pbt_minimal"),
        "prodigy": lambda: run_single("prodigy", 1.0, base, world, work / "prodigy"),
        "schedulefree": lambda: run_single("schedulefree", center, base, world, work / "schedulefree"),
        "lr_find": lambda: finder_arm(center, base, world, work / "lr_find"),
    }
    for vote in args.votes:
        where = work / f"hdet_{vote.replace(':', '_').replace('>', '_then_')}"
        if ">" in vote:
            jobs[f"hdet_{vote}"] = lambda vote=vote, where=where: run_two_step(lrs, base, args, vote, where)
        else:
            jobs[f"hdet_{vote}"] = lambda vote=vote, where=where: run_hdet_arm(
                lrs, base, world, args.groups, args.pbt_interval, vote, args.hdet_blend, args.start_method, where,
                refine_spread=args.two_step_spread, search_fraction=args.search_fraction)
    if args.full_grid is not None and (not args.full_grid or start in args.full_grid):
        jobs["grid_xG"] = lambda: run_grid("grid_xG", lrs, whole_batch(base, world), world, work / "grid_xG")
    if args.pbt_seeds is not None and seed >= args.first_seed + args.pbt_seeds:
        del jobs["pbt"]  # Ray Tune's PBT on the first seeds only (--pbt-seeds): its start-ups cost minutes per arm
    return [Arm(workload, method, start, seed, **job()) for method, job in jobs.items() if method in args.run_methods]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny budget, one seed (about a minute on 2 cores)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=ALL_WORKLOADS, metavar="WORKLOAD",
                   help=f"of {list(ALL_WORKLOADS)} (default {list(WORKLOADS)})")
    p.add_argument("--world-size", type=int, default=4, help="W: processes of the job")
    p.add_argument("--starts", nargs="+", default=list(DEFAULT_STARTS), choices=list(STARTS), metavar="START",
                   help=f"starting LRs to run, of {list(STARTS)} (default {list(DEFAULT_STARTS)})")
    p.add_argument("--methods", nargs="*", default=[m for m in BASELINES if m not in ("pbt_minimal", "lr_find")],
                   choices=BASELINES, metavar="METHOD",
                   help=f"baselines to run, of {list(BASELINES)} (default all but pbt_minimal, the Ray-free "
                   "re-implementation of PBT, and lr_find, Lightning's Tuner.lr_find + DDP at its suggestion; pbt is "
                   "skipped when Ray is missing)")
    p.add_argument("--hdet-votes", default="best,softmax",
                   help="comma-separated HDETCallback vote names, each optionally with a signal and the strategy's "
                   "gradient_sync (VOTE[:SIGNAL][@SYNC], e.g. pbt@global; default signal mean, sync "
                   "group), one HDET arm each (default best,softmax); FIRST>SECOND (e.g. pbt>pbt@global) runs FIRST "
                   "for half the steps, then SECOND from its model around the LR it found (--two-step-spread); "
                   "VOTE+search (e.g. pbt+search) does that in one fit (HDETCallback(search=Search()), "
                   "--search-fraction)")
    p.add_argument("--two-step-spread", type=float, default=1.5,
                   help="FIRST>SECOND and +search arms: factor between neighbouring LRs of the second half's grid")
    p.add_argument("--search-fraction", type=float, default=SEARCH_FRACTION,
                   help=f"+search arms: the fraction of the steps from which the search may end (default "
                   f"{SEARCH_FRACTION}, Search()'s)")
    p.add_argument("--hdet-blend", default="best", choices=("best", "mean", "weighted"), help="HDETCallback blend")
    p.add_argument("--start-method", default="spawn", choices=("spawn", "fork"),
                   help="how HDET starts its processes: spawn (as users do) or fork (skips the ~10 s of imports "
                   "per run on a loaded machine; changes no number but the wall-clock)")
    p.add_argument("--full-grid", nargs="*", default=None, choices=list(STARTS), metavar="START",
                   help="also run the grid with every run as large as the whole job (G x the compute), from these "
                   "starts (none named: every start)")
    p.add_argument("--schedule", default="constant", choices=("constant", "cosine"),
                   help="the LR schedule of every run but the char LM's: constant (a bare optimizer) or cosine "
                   "(CosineAnnealingLR to zero over the run, set up in the model's configure_optimizers)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "schedulefree", "prodigy"),
                   help="the optimizer whose LR grid, TPE, PBT and HDET search (default adamw; sgd: SGD with "
                   "momentum 0.9; schedulefree: "
                   "schedule-free AdamW, the baseline's optimizer; prodigy: Prodigy, whose lr multiplies its own "
                   "estimate, so the starts are 1.0 and 10x either side); prodigy and schedulefree runs keep their own")
    p.add_argument("--groups", type=int, default=4, help="G: LRs in the grid / trials / PBT members / HDET groups")
    p.add_argument("--steps", type=int, default=None, help="S: steps per run (default 320, quick 16)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3, quick 1)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds are --first-seed, +1, ... (to split a run)")
    p.add_argument("--pbt-seeds", type=int, default=None,
                   help="run Ray Tune's PBT on the first this many seeds only (default every seed): on a 2-core "
                   "machine its actor start-ups and checkpoints cost minutes per arm, far more than its training")
    p.add_argument("--merge", nargs="+", type=Path, default=[], metavar="JSON",
                   help="train nothing: summarise the arms of these result files (parts of one run made in "
                   "parallel, e.g. one per workload and seed, with the same settings) into the table and plot")
    p.add_argument("--good-lr", nargs="+", default=[], metavar="WORKLOAD=LR",
                   help=f"override the good starting LR per workload (default {GOOD_LR})")
    p.add_argument("--lr-spread", type=float, default=3.0, help="factor between neighbouring grid LRs")
    p.add_argument("--pbt-interval", type=int, default=None,
                   help="T: PBT steps between perturbations, and HDET steps between votes (default S/4)")
    p.add_argument("--val-every", type=int, default=None, help="steps between validations (default S/8)")
    p.add_argument("--val-batches", type=int, default=None, help="validation batches of the per-process size, a "
                   "multiple of --world-size (default 8, quick 4)")
    p.add_argument("--batch-size", type=int, default=None, help="per-process batch size (default 16, quick 8)")
    p.add_argument("--max-chars", type=int, default=1_000_000, help="char LM: corpus bytes")
    p.add_argument("--d-model", type=int, default=None, help="char LM: model width (default 64, quick 32)")
    p.add_argument("--n-layers", type=int, default=2, help="char LM: Transformer blocks")
    p.add_argument("--width", type=int, default=None, help="shapes: channels of the first conv (default 16, quick 8)")
    p.add_argument("--init-nudge", type=int, default=0, metavar="K",
                   help="K > 0: after the seed's initialisation, move a K-seeded random half of every parameter's "
                   "elements one ULP up (torch.nextafter toward +inf), the same weights for every arm: measures how "
                   "far a change in the last bits moves a run (default 0: the seed's weights, bit-identical)")
    p.add_argument("--margin", type=float, default=0.03, help="target = (1 + margin) × best loss reached")
    p.add_argument("--name", default=NAME, help="name of the results file and of the docs block (e.g. for a table of "
                   "extra seeds beside the main one)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--docs-dir", type=Path, default=DOCS_DIR)
    args = p.parse_args(argv)
    fill_defaults(p, args)
    return args


def fill_defaults(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Quick or full defaults; which methods run (skipped votes and a missing Ray are recorded)."""
    if args.groups < 1 or args.world_size % args.groups:
        p.error(f"--world-size={args.world_size} must be a positive multiple of --groups={args.groups}")
    q = args.quick
    args.steps = args.steps or (16 if q else 320)
    args.batch_size = args.batch_size or (8 if q else 16)
    args.d_model = args.d_model or (32 if q else 64)
    args.width = args.width or (8 if q else 16)
    args.seeds = args.seeds or (1 if q else 3)
    args.pbt_interval = args.pbt_interval or max(args.steps // 4, 1)
    args.val_every = args.val_every or max(args.steps // 8, 1)
    args.val_batches = args.val_batches or (4 if q else 8)
    if args.val_batches % args.world_size:  # the whole-batch arms validate on the same samples in fewer batches
        p.error(f"--val-batches={args.val_batches} must be a multiple of --world-size={args.world_size}")
    if any(">" in v for v in args.hdet_votes.split(",")) and args.steps % (2 * args.pbt_interval):
        p.error(f"a FIRST>SECOND arm runs --steps={args.steps} in two halves: they must be multiples of "
                f"--pbt-interval={args.pbt_interval}")
    if args.init_nudge < 0:
        p.error(f"--init-nudge={args.init_nudge} must be >= 0 (0: the seed's weights as they are)")
    if not 0 < args.search_fraction < 1:
        p.error(f"--search-fraction={args.search_fraction} must lie in (0, 1)")
    for flag, value in (("--pbt-interval", args.pbt_interval), ("--val-every", args.val_every)):
        if args.steps % value:
            p.error(f"{flag}={value} must divide --steps={args.steps} so every method spends the whole budget")
    if "lr_find" in args.methods and args.steps <= math.ceil(FINDER_STEPS / args.world_size):
        p.error(f"lr_find spends {FINDER_STEPS} one-process steps of the budget: --steps={args.steps} must exceed "
                f"{math.ceil(FINDER_STEPS / args.world_size)} at --world-size={args.world_size}")
    if args.schedule != "constant" and "char_lm" in args.workloads:
        p.error(f"--schedule={args.schedule} applies to the shapes and tabular workloads; the char LM has its own "
                "scheduler option: drop char_lm from --workloads")
    # Prodigy's lr multiplies its own step-size estimate: 1.0 is its good value whatever the workload
    good = ({w: 1.0 for w in ALL_WORKLOADS} if args.optimizer == "prodigy"
            else GOOD_LRS.get(("adamw" if args.optimizer == "schedulefree" else args.optimizer, args.schedule), {}))
    try:
        args.good_lr = {**good, **{k: float(v) for k, v in (item.split("=", 1) for item in args.good_lr)}}
    except ValueError:
        p.error(f"--good-lr takes WORKLOAD=LR pairs, got {args.good_lr}")
    missing = [w for w in args.workloads if w not in args.good_lr]
    if missing and not args.merge:
        p.error(f"no good LR measured for {missing} with --optimizer={args.optimizer} --schedule={args.schedule}: "
                "give --good-lr WORKLOAD=LR (benchmarks/search_calibrate.py measures it)")
    args.votes, args.skipped = accepted_votes([v for v in args.hdet_votes.split(",") if v])
    if "pbt" in args.methods and not ray_available():
        args.skipped["pbt"] = "Ray Tune is not installed (pip install 'ray[tune]', or the `bench` extra)"
    args.run_methods = [m for m in args.methods if m not in args.skipped]
    args.run_methods += [f"hdet_{v}" for v in args.votes] + (["grid_xG"] if args.full_grid is not None else [])


def merge(args: argparse.Namespace) -> tuple[list[Arm], float]:
    """The arms of ``args.merge``'s result files and their summed wall-clock; ``args`` takes the workloads,
    starts, methods and seeds found there (the other settings are the command line's: pass the same ones)."""
    parts = [json.loads(path.read_text()) for path in args.merge]
    arms = [Arm(**arm) for part in parts for arm in part["arms"]]

    def present(key: str) -> list:
        return list(dict.fromkeys(getattr(a, key) for a in arms))  # in order of appearance

    args.workloads, args.starts = present("workload"), present("start")
    methods = present("method")  # in the order of a single run: baselines, HDET arms, grid x G
    args.run_methods = ([m for m in BASELINES if m in methods] + [m for m in methods if m.startswith("hdet_")]
                        + [m for m in methods if m == "grid_xG"])
    args.votes = [m.removeprefix("hdet_") for m in args.run_methods if m.startswith("hdet_")]
    args.seeds = len(set(present("seed")))
    for part in parts:
        args.skipped.update(part.get("skipped", {}))
    return arms, sum(part["total_wall_s"] for part in parts)


def curve_panels(arms: list[Arm], workloads: list[str], starts: list[str]) -> dict[str, dict[str, tuple]]:
    """The plot's panels, one per workload and start: each method's best-so-far curve on one seed, the first the
    arms ran (a table of seeds 3-5 has no seed 0)."""
    first = min((a.seed for a in arms), default=0)
    return {
        f"{w}, start: {s}": {
            a.method: ([c for c, _, _ in a.curve], [v for _, v, _ in a.curve])
            for a in arms if a.workload == w and a.start == s and a.seed == first and a.curve
        }
        for w in workloads for s in starts
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    name, t0 = begin(args.name, args.quick)
    if args.merge:
        arms, total_s = merge(args)
    else:
        arms = []
        with tempfile.TemporaryDirectory(prefix=name) as tmp:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                for workload in args.workloads:
                    for start in args.starts:
                        work = Path(tmp) / f"seed{seed}" / workload / start.replace(" ", "_")
                        arms += run_start(workload, start, args, seed, work)
        total_s = time.perf_counter() - t0
    summary = summarise(arms, args, STARTS)
    config = {k: [str(p) for p in v] if k == "merge" else str(v) if isinstance(v, Path) else v
              for k, v in vars(args).items()}
    payload = {"config": config, "total_wall_s": total_s, **summary, "arms": [vars(a) for a in arms]}
    write_json(name, payload, args.results_dir, args.max_chars)
    plot = plot_panels(
        args.docs_dir / "img" / f"{name}.png",
        curve_panels(arms, args.workloads, args.starts),
        "compute (rank-steps)",
        "best validation loss so far",
        rows=len(args.workloads),
    )
    stamped = stamp(sorted({a.seed for a in arms}))  # a merge's parts may have run any seeds
    figure = f"\n\n![{name}](img/{plot.name})\n\n"
    detail = tables(summary, args, STARTS, total_s)
    if block_page(args.docs_dir, name).name == "benchmarks.md":  # the results page: one table; the rest to the log
        write_block(args.docs_dir, name, page_table(summary, args, total_s) + figure + stamped)
        write_block(args.docs_dir, f"{name}_detail", detail + "\n\n" + stamped)
    else:
        write_block(args.docs_dir, name, detail + figure + stamped)
    print(detail)
    return payload


if __name__ == "__main__":
    main()
