"""Harness for the benchmarks: run a Lightning fit of a workload (the char LM or the shapes CNN) on N CPU processes, record curves,
summarise over seeds, and write JSON results, markdown tables (into docs/benchmarks.md, or the research log under docs/research/) and PNG plots.

A run on one process trains in this process; a run on several spawns them with Lightning's
``ddp_spawn`` machinery over ``gloo`` (or the strategy object passed in). Each rank writes its own
record (``rank{r}.json``) so per-rank values, which differ under HDET, survive the spawn.
"""

from __future__ import annotations

import argparse
import json
import itertools
import logging
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy, Strategy

from lightning_hdet.demos import CharCorpusDataModule, CharLM, ShapesCNN, ShapesDataModule, load_corpus
from lightning_hdet.demos.corpus import DEFAULT_MAX_CHARS, VOCAB_SIZE
from lightning_hdet.demos.shapes import CLASSES
from lightning_hdet.demos.tabular import TabularDataModule, TabularMLP, make_tabular, prior_loss

# One thread per process for every benchmark, as `make bench` runs them (the Makefile exports OMP_NUM_THREADS=1),
# whether or not the caller exported it: a stamp must not depend on the shell it was run from. A conv net trained by
# SGD near its largest stable LR ends several per cent apart after a change in the last bits of its arithmetic, which
# a different thread count makes (2026-12-07: the CNN's untuned DDP run at its good LR ended at 0.896 with one
# thread and 0.939 with the caller's variable unset). An explicit OMP_NUM_THREADS is kept and recorded (`machine`).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
DOCS_DIR = REPO / "docs"
# The workloads: a byte-level Transformer LM on text, a conv net on procedurally generated images and an MLP on
# generated tabular data.
WORKLOADS = ("char_lm", "shapes", "tabular")
TABULAR_TRAIN = 16384  # the tabular training set's rows (TabularDataModule's default)
# Issue 59's workloads whose data repeat: a 300-step run of 4 processes x batch 32 (38,400 samples) reads the
# small tabular set 37 times and the small shapes set 25 times, so they memorise and the held-out loss rises
# when over-trained. Validated on a separate held-out set of SMALL_VAL items (other rows / images), and the model a
# run hands back scored on SMALL_TEST more that no validation reads: HDET's votes read the validation loss where the
# data repeat (monitor="auto"), and a score on the same items would reward the vote for reading them.
SMALL_TRAIN = {"tabular_small": 1024, "shapes_small": 1536}
SMALL_VAL = 512
SMALL_TEST = 512
ALL_WORKLOADS = WORKLOADS + tuple(SMALL_TRAIN)  # what a script may name; WORKLOADS stays its default
# Loss of a constant predictor: where a collapsed run sits (uniform over the outputs; tabular: the training
# labels' own distribution, which the teacher does not balance).
CHANCE_LOSS = {"char_lm": math.log(VOCAB_SIZE), "shapes": math.log(len(CLASSES)),
               "tabular": prior_loss(make_tabular(TABULAR_TRAIN)[1], 8),
               "tabular_small": prior_loss(make_tabular(SMALL_TRAIN["tabular_small"])[1], 8),
               "shapes_small": math.log(len(CLASSES))}


@dataclass
class RunSpec:
    """One training run of ``workload``: :class:`CharLM` on :class:`CharCorpusDataModule` (``"char_lm"``),
    :class:`ShapesCNN` on :class:`ShapesDataModule` (``"shapes"``) or :class:`TabularMLP` on
    :class:`TabularDataModule` (``"tabular"``; ``block_size`` and ``max_chars`` unused but by the char LM);
    ``"tabular_small"`` and ``"shapes_small"`` are the same models on small training sets (:data:`SMALL_TRAIN`).

    ``steps`` is the global step to stop at (cumulative when resuming); ``devices`` the number of
    processes; ``model`` extra model arguments (``optimizer``, ``d_model``, ...). ``shard_data=False``
    gives every process the whole training and validation streams in the same order (Lightning's
    ``use_distributed_sampler=False``), as independent one-process runs would see them: the training order is
    fixed by ``seed`` (the datamodules' ``shuffle_seed``), however the processes were started. ``shard_train``
    (with ``shard_data=False``) shards only the training stream: every process validates on the same batches.
    ``init_nudge`` > 0 moves the seed's initial weights by one ULP (:func:`nudge_weights`): a change in the last
    bits of the arithmetic, to measure how far such a change moves a run; 0 leaves them as they are.
    """

    lr: float
    steps: int
    seed: int = 0
    devices: int = 1
    batch_size: int = 16
    block_size: int = 64
    max_chars: int = DEFAULT_MAX_CHARS
    val_every: int = 50
    val_batches: int = 8
    model: dict = field(default_factory=dict)
    shard_data: bool = True
    workload: str = "char_lm"
    shard_train: bool = False
    init_nudge: int = 0
    #: the final score reads the ``val_batches`` validation batches after the first ones, which validation (and an
    #: outer lookahead, ``LookaheadLR``) read: data nothing in the run chose by
    held_out: bool = False


@dataclass
class RunResult:
    """What one run produced, per rank (ranks differ under HDET; under DDP only their validation shards do).

    ``rank_val_curves[r]`` rows are ``(global_step, val_loss, seconds since the fit started)``;
    ``rank_lrs[r]`` is rank r's final LR (for Prodigy, ``lr`` times its own estimate ``d``). ``fit_s`` is rank 0's time inside ``fit``; ``wall_s`` adds
    process start-up as seen by the caller. ``rank_extra[r]`` is what the strategy knows at the end of the
    fit (see :func:`strategy_record`); ``final_model_val_loss`` is the validation loss of the model the fit
    handed back (merged under HDET, global under async/DiLoCo) on the first ``val_batches`` validation
    batches, the same batches for every run. Convenience properties read rank 0.
    """

    spec: RunSpec
    rank_val_curves: list[list[tuple[int, float, float]]]
    train_loss: list[float]
    rank_lrs: list[float]
    fit_s: float
    wall_s: float
    rank_extra: list[dict] = field(default_factory=list)
    final_model_val_loss: float = math.nan

    @property
    def val_curve(self) -> list[tuple[int, float, float]]:
        return self.rank_val_curves[0]

    @property
    def final_val_loss(self) -> float:
        return self.val_curve[-1][1] if self.val_curve else math.nan

    @property
    def best_val_loss(self) -> float:
        finite = [v for _, v, _ in self.val_curve if math.isfinite(v)]
        return min(finite) if finite else math.inf

    @property
    def diverged(self) -> bool:
        """True when any of rank 0's training losses or its final validation loss is not finite."""
        return not all(map(math.isfinite, self.train_loss)) or not math.isfinite(self.final_val_loss)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "final_val_loss": self.final_val_loss,
            "best_val_loss": self.best_val_loss,
            "diverged": self.diverged,
        }


class _SetLR(Callback):
    """Put every param group (and any scheduler's base LR) at ``lr`` when training starts: restoring a
    checkpoint brings back its old LR, and population-based training changes it between rounds."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["lr"] = self.lr
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [self.lr] * len(config.scheduler.base_lrs)


def adaptive_rounds(local_steps: int, mode: str = "async") -> Any:
    """``local_steps`` for rounds adapted to the workers' speeds from ``H`` in async mode (``AdaptiveSteps(start=H)``,
    what an integer meant there until issue 60); DiLoCo's ``H``."""
    from lightning_hdet import AdaptiveSteps

    return AdaptiveSteps(local_steps) if mode == "async" else local_steps


def strategy_record(trainer: Trainer) -> dict:
    """What an HDET or async strategy knows at the end of the fit: every group's real LRs, skipped steps and
    the vote history (HDET); inner steps, rounds and, on rank 0, the outer optimizer's per-worker view (async)."""
    from lightning_hdet import AsyncLocalSGDStrategy, HDETCallback, HDETStrategy

    strategy = trainer.strategy
    if isinstance(strategy, HDETStrategy):
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, HDETCallback))
        return {
            "group_index": strategy.group_index,
            "group_lrs": strategy.current_lrs()[:, 0].tolist(),
            "skipped_steps": strategy.skipped_steps,
            "rescues": callback.rescues,
            "history": callback.history,
        }
    if isinstance(strategy, AsyncLocalSGDStrategy):
        return {
            "inner_steps": strategy.inner_steps,
            "rounds": strategy.rounds,
            "worker_stats": {str(w): v for w, v in strategy.worker_stats().items()},
        }
    return {}


class _Recorder(Callback):
    """Each rank records its training losses and validation curve and writes ``rank{r}.json``;
    optionally saves a full checkpoint (model and optimizer) at the end of the fit."""

    def __init__(self, out_dir: Path, save_ckpt: Path | None) -> None:
        self.out_dir = out_dir
        self.save_ckpt = save_ckpt

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.t0 = time.perf_counter()
        self.train_loss: list[float] = []
        self.val_curve: list[tuple[int, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_loss.append(float(loss))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            loss = float(trainer.callback_metrics["val_loss"])
            self.val_curve.append((trainer.global_step, loss, time.perf_counter() - self.t0))

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        fit_s = time.perf_counter() - self.t0
        if self.save_ckpt is not None:
            trainer.save_checkpoint(self.save_ckpt)
        group = trainer.optimizers[0].param_groups[0]
        record = {
            "train_loss": self.train_loss,
            "val_curve": self.val_curve,
            "lr": group["lr"] * group.get("d", 1.0),  # Prodigy's step size is its estimate d times lr
            "fit_s": fit_s,
            "extra": strategy_record(trainer),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class _LoadWeights(Callback):
    """Every rank starts from the weights saved at ``path`` (a ``state_dict``) instead of the model's own
    initialisation: a second fit continuing from a first one's final model, with a fresh optimizer."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pl_module.load_state_dict(torch.load(self.path, weights_only=True))


# When this process's benchmark started (set by :func:`begin`): the wall-clock of its tables' stamps.
_STARTED = time.perf_counter()


def begin(base: str, quick: bool) -> tuple[str, float]:
    """Start a benchmark script: silence Lightning's per-run banners and warnings that would drown the tables,
    and return the run's name (``base``, with ``_quick`` in quick mode) and its start time."""
    global _STARTED
    _STARTED = time.perf_counter()
    warnings.filterwarnings("ignore")
    for logger in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    return base + ("_quick" if quick else ""), time.perf_counter()


def fit_run(
    spec: RunSpec,
    workdir: Path,
    strategy: Strategy | str | None = None,
    callbacks: Sequence[Callback] = (),
    ckpt_path: Path | None = None,
    save_ckpt: Path | None = None,
    init_weights: Path | None = None,
    save_weights: Path | None = None,
) -> RunResult:
    """Train ``spec`` and return its record. ``strategy`` defaults to ``ddp_spawn`` over ``gloo`` when
    ``spec.devices > 1``; ``ckpt_path`` resumes (weights, optimizer, step) at ``spec.lr``;
    ``save_ckpt`` writes a checkpoint at the end; ``init_weights`` starts from a saved ``state_dict`` (weights
    only) and ``save_weights`` saves the final model's (the merged one under HDET).

    ``BENCH_ACCELERATOR=cuda`` in the environment trains on the one GPU: all ``spec.devices`` processes
    share ``cuda:0`` and talk over ``gloo`` (NCCL needs one GPU per rank); used by ``gpu_check.sh``. With
    ``BENCH_BACKEND=nccl`` too, rank r uses ``cuda:r`` (the strategy passed in must use ``nccl``)."""
    accelerator = os.environ.get("BENCH_ACCELERATOR", "cpu")
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"BENCH_ACCELERATOR={accelerator!r} is not supported; use 'cpu' or 'cuda'")
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob("rank*.json"):
        stale.unlink()
    if strategy is None:
        strategy = (
            DDPStrategy(start_method="spawn", process_group_backend="gloo") if spec.devices > 1 else "auto"
        )
    if accelerator == "cuda" and spec.devices > 1:
        # BENCH_BACKEND=nccl: one GPU per rank (NCCL needs that); otherwise every rank shares cuda:0 over gloo
        nccl = os.environ.get("BENCH_BACKEND") == "nccl"
        strategy.parallel_devices = [torch.device("cuda", r if nccl else 0) for r in range(spec.devices)]
    seed_everything(spec.seed, verbose=False)
    model, data = build_workload(spec)
    trainer = Trainer(
        accelerator=accelerator,
        devices=1 if accelerator == "cuda" else spec.devices,
        strategy=strategy,
        max_steps=spec.steps,
        val_check_interval=spec.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=spec.val_batches,
        num_sanity_val_steps=0,
        use_distributed_sampler=spec.shard_data,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=workdir,
        callbacks=[_SetLR(spec.lr), _Recorder(workdir, save_ckpt), *callbacks,
                   *([_LoadWeights(init_weights)] if init_weights is not None else [])],
    )
    start = time.perf_counter()
    trainer.fit(model, data, ckpt_path=ckpt_path)
    wall_s = time.perf_counter() - start
    if save_weights is not None:
        torch.save(model.state_dict(), save_weights)
    ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(spec.devices)]
    return RunResult(
        spec=spec,
        rank_val_curves=[[tuple(row) for row in r["val_curve"]] for r in ranks],
        train_loss=ranks[0]["train_loss"],
        rank_lrs=[r["lr"] for r in ranks],
        fit_s=ranks[0]["fit_s"],
        wall_s=wall_s,
        rank_extra=[r["extra"] for r in ranks],
        final_model_val_loss=evaluate(model, data, spec.val_batches, test_items(spec),
                                      skip=spec.val_batches if spec.held_out else 0),
    )


def build_workload(spec: RunSpec) -> tuple[LightningModule, LightningDataModule]:
    """The model (at ``spec.lr``, with ``spec.model``'s arguments, its initial weights nudged by
    ``spec.init_nudge``) and the data of ``spec.workload``. Every arm builds its model here, so all start from the
    same (nudged) weights."""
    model, data = _workload(spec)
    nudge_weights(model, spec.init_nudge)
    return model, data


@torch.no_grad()
def nudge_weights(model: torch.nn.Module, nudge: int) -> None:
    """Move a random half of every parameter's elements one ULP up (``torch.nextafter`` toward +inf), the half
    drawn from a generator seeded by ``nudge`` alone (the global RNG is untouched, so the data order and every
    later draw stay the seed's); ``nudge=0`` changes nothing. The same ``nudge`` gives the same half on every
    model of the same shapes, whatever its seed."""
    if not isinstance(nudge, int) or nudge < 0:
        raise ValueError(f"init_nudge={nudge!r} must be an int >= 0 (0: the seed's weights as they are)")
    if nudge == 0:
        return
    generator = torch.Generator().manual_seed(nudge)
    for param in model.parameters():
        up = torch.rand(param.shape, generator=generator) < 0.5
        param.copy_(torch.where(up.to(param.device), torch.nextafter(param, torch.full_like(param, math.inf)), param))


def _workload(spec: RunSpec) -> tuple[LightningModule, LightningDataModule]:
    """:func:`build_workload`'s model (its seed's weights) and data."""
    if spec.workload == "char_lm":
        model = CharLM(block_size=spec.block_size, lr=spec.lr, **spec.model)
        return model, CharCorpusDataModule(spec.block_size, spec.batch_size, spec.max_chars, shuffle_seed=spec.seed,
                                           shard_train=spec.shard_train)
    if spec.workload == "shapes":
        # The data seed is fixed: every run sees the same images; the shuffle follows ``spec.seed``.
        data = ShapesDataModule(batch_size=spec.batch_size, shuffle_seed=spec.seed, shard_train=spec.shard_train)
        return ShapesCNN(lr=spec.lr, **spec.model), data
    if spec.workload == "tabular":  # the same rows in every run, like shapes
        data = TabularDataModule(batch_size=spec.batch_size, num_train=TABULAR_TRAIN, shuffle_seed=spec.seed,
                                 shard_train=spec.shard_train)
        return TabularMLP(lr=spec.lr, **spec.model), data
    if spec.workload in SMALL_TRAIN:  # issue 59's repeating data (SMALL_TRAIN), the same items in every run
        kind = TabularDataModule if spec.workload == "tabular_small" else ShapesDataModule
        data = kind(batch_size=spec.batch_size, num_train=SMALL_TRAIN[spec.workload], num_val=SMALL_VAL + SMALL_TEST,
                    shuffle_seed=spec.seed, shard_train=spec.shard_train)
        model = TabularMLP if spec.workload == "tabular_small" else ShapesCNN
        return model(lr=spec.lr, **spec.model), data
    raise ValueError(f"workload={spec.workload!r} is not one of {ALL_WORKLOADS}")


@torch.no_grad()
def test_items(spec: RunSpec) -> int:
    """The validation set's last items kept for the final score (:data:`SMALL_TEST`; 0: the first batches are scored,
    as validation reads them). Validation must not reach them: refused where its batches would."""
    if spec.workload not in SMALL_TRAIN:
        return 0
    if spec.val_batches * spec.batch_size > SMALL_VAL:
        raise ValueError(f"val_batches={spec.val_batches} of {spec.batch_size} would validate on {spec.workload}'s "
                         f"test items (validation has {SMALL_VAL}): use at most {SMALL_VAL // spec.batch_size}")
    return SMALL_TEST


def evaluate(model: LightningModule, data: LightningDataModule, batches: int, test: int = 0, skip: int = 0) -> float:
    """Mean validation loss of ``model`` (in this process, on CPU) over the first ``batches`` batches after ``skip``;
    with ``test``, over the validation set's last ``test`` items instead (which no validation read)."""
    data.setup("validate")
    model = model.cpu().eval()
    if test:
        x, y = data.val_set[len(data.val_set) - test:]
        logits = model(x)
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    losses = []
    for (x, y), _ in zip(itertools.islice(data.val_dataloader(), skip, None), range(batches)):
        logits = model(x)
        losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    return sum(losses) / len(losses)


def best_so_far(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Sort ``(compute, loss, seconds)`` by compute and keep the running minimum of the loss (non-finite
    losses count as no progress)."""
    out, best = [], math.inf
    for compute, loss, secs in sorted(points):
        best = min(best, loss) if math.isfinite(loss) else best
        out.append((compute, best, secs))
    return out


def median(values: Iterable[float | None]) -> float | None:
    """Median over seeds; ``None`` (e.g. target never reached) counts as +inf, all-``None`` gives ``None``."""
    vals = [math.inf if v is None else v for v in values]
    if not vals:
        return None
    m = statistics.median(vals)
    return None if math.isinf(m) else m


def fmt(value: float | None, spec: str = ".3f") -> str:
    """Table cell: a number, ``—`` for missing, ``inf``/``nan`` spelled out."""
    if value is None:
        return "—"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    """What the numbers were measured on. ``cpu`` and ``cpu_capability`` (the vector kernels torch picked): a conv
    net trained with SGD near its largest stable LR ends up to 1.8x apart after a change in the last bits of its
    arithmetic (docs/research/2026-12-hdet-search.md), so another CPU can move its numbers with the same code."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write_json(name: str, payload: dict, results_dir: Path = RESULTS_DIR, max_chars: int = DEFAULT_MAX_CHARS) -> Path:
    """Write ``results_dir/name.json`` with the machine, the command and the corpus fingerprint added."""
    results_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "corpus_fingerprint": load_corpus(max_chars).fingerprint,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=float))
    return path


# The line under every generated block: who made it, how, when, where, on which seeds, in how long. Legacy
# stamps (blocks generated before stamps existed) say what their results file recorded and "unknown" for the rest.
STAMP = re.compile(
    r"^\*Stamp(?P<legacy> \(legacy\))? · commit (?P<commit>\S+) · command `(?P<command>[^`]+)` · "
    r"date (?P<date>[^·]+) · machine (?P<machine>[^·]+) · seeds (?P<seeds>[^·]+) · wall-clock (?P<wall>[^*]+)\*$"
)


def git_commit(repo: Path = REPO) -> str:
    """The short commit of ``repo``'s HEAD, ``+dirty`` when the package or the benchmark scripts differ from it
    (the tables then come from uncommitted code on top of it); ``unknown`` outside a git checkout."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--", "lightning_hdet", "benchmarks/*.py", "tests/scripts")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def this_command() -> str:
    """This process's command line as a user would type it from the repository root (``python benchmarks/x.py
    ...``): the form the stamps record and ``benchmarks/run_all.py`` compares with its parts' commands."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO).as_posix() if script.is_relative_to(REPO) else str(script)
    return shlex.join(["python", shown, *sys.argv[1:]])


def seeds_text(seeds: Iterable[int] | None) -> str:
    """``0–2`` for a run of three or more consecutive seeds, ``0, 1`` otherwise, ``none`` when unseeded."""
    seeds = sorted(set(seeds or ()))
    if not seeds:
        return "none"
    if len(seeds) >= 3 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


def args_seeds(args: argparse.Namespace) -> list[int]:
    """The seeds a script's arguments name: ``--seeds`` (a count) from ``--first-seed`` or ``--seed``, else
    ``--seed`` alone; none when the script takes no seed."""
    first = getattr(args, "first_seed", getattr(args, "seed", None))
    count = getattr(args, "seeds", None)
    if isinstance(count, int):
        return list(range(first or 0, (first or 0) + count))
    return [] if first is None else [first]


def wall_text(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


def stamp(seeds: Iterable[int] | None, wall_s: float | None = None) -> str:
    """The stamp line of a block generated now by this process (see :data:`STAMP`)."""
    m = machine()
    where = f"{m['cpu_count']} cores ({m['cpu_capability']}), {platform.system()}, Python {m['python']}, " \
            f"torch {m['torch']}, lightning {m['lightning']}"
    if os.environ.get("BENCH_ACCELERATOR", "cpu") != "cpu":
        where += f", accelerator {os.environ['BENCH_ACCELERATOR']}"
    wall = time.perf_counter() - _STARTED if wall_s is None else wall_s
    return (f"*Stamp · commit {git_commit()} · command `{this_command()}` · "
            f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · machine {where} · "
            f"seeds {seeds_text(seeds)} · wall-clock {wall_text(wall)}*")


# Pages of the research log whose generated blocks no page holds yet (a first run of a research table): the
# others go to the results page, docs/benchmarks.md. A block found on any page is rewritten where it stands.
RESEARCH_BLOCKS = {"search_baselines_detail": "research/2026-12-hdet-search.md",
                   "search_long": "research/2026-12-hdet-search.md"}
# Issue 59's cells (run_all.py's search_repeat_* parts, their first measurement and any variant named so) too.
RESEARCH_PREFIXES = {"search_repeat": "research/2026-12-hdet-search.md"}


def block_page(docs_dir: Path, name: str) -> Path:
    """The page under ``docs_dir`` that holds ``name``'s generated block (its markers on lines of their own), else
    its page in :data:`RESEARCH_BLOCKS` (or by its prefix, :data:`RESEARCH_PREFIXES`), else
    ``docs_dir / "benchmarks.md"``: a block moved to the research log keeps being rewritten there."""
    marker = re.compile(rf"^<!-- BEGIN {re.escape(name)} -->$", re.M)
    for page in sorted(docs_dir.rglob("*.md")):
        if marker.search(page.read_text()):
            return page
    prefixed = (page for prefix, page in RESEARCH_PREFIXES.items() if name.startswith(prefix))
    return docs_dir / RESEARCH_BLOCKS.get(name, next(prefixed, "benchmarks.md"))


def write_block(docs_dir: Path, name: str, markdown: str) -> Path:
    """Put ``markdown`` between ``name``'s markers on its page (:func:`block_page`), its plots' links (``img/...``,
    relative to docs/) made relative to that page; returns the page."""
    page = block_page(docs_dir, name)
    up = "../" * (len(page.relative_to(docs_dir).parts) - 1)
    update_doc_section(page, name, markdown.replace("](img/", f"]({up}img/") if up else markdown)
    return page


def update_doc_section(doc: Path, name: str, markdown: str) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``doc``
    (appending the markers at the end when absent)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{markdown.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def plot_panels(
    path: Path, panels: dict[str, dict[str, tuple[Sequence[float], Sequence[float]]]], xlabel: str, ylabel: str,
    rows: int = 1,
) -> Path:
    """One subplot per panel, one line per label, on ``rows`` rows (panels of a row share the y axis); saved
    as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = math.ceil(len(panels) / rows)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.6 * rows), squeeze=False, sharey="row")
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for i, (label, (xs, ys)) in enumerate(lines.items()):
            # past the 10 colours of the default cycle, a new line style keeps every label distinct
            ax.plot(xs, ys, marker=".", label=label, linestyle=("-", "--", ":")[i // 10 % 3])
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel(ylabel)
        row[-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside, not over
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark script shares: ``--quick`` and where results and docs go."""
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of the harness, not a result")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--docs-dir", type=Path, default=DOCS_DIR)


def publish(name: str, args: argparse.Namespace, payload: dict, markdown: str, max_chars: int = DEFAULT_MAX_CHARS,
            seeds: Iterable[int] | None = None) -> None:
    """Write ``name.json`` (with the script's arguments as ``config``), put ``markdown`` and its :func:`stamp`
    between ``name``'s markers on its page (:func:`write_block`: the results page unless the block lives in the
    research log), and print them. ``seeds`` defaults to those the arguments name (:func:`args_seeds`)."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_json(name, {"config": config, **payload}, args.results_dir, max_chars)
    markdown = f"{markdown.rstrip()}\n\n{stamp(args_seeds(args) if seeds is None else seeds)}"
    write_block(args.docs_dir, name, markdown)
    print(markdown, flush=True)


def not_finite_or_worse_than_uniform(loss: float, workload: str = "char_lm") -> bool:
    """A crashed run: its loss is not finite or no better than a constant predictor (:data:`CHANCE_LOSS`;
    within 1 %, since a collapsed run hovers around it)."""
    return not math.isfinite(loss) or loss >= 0.99 * CHANCE_LOSS[workload]


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Model, data and validation options of the char-LM runs; :func:`fill_run_defaults` fills the defaults."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=None, help="per process (default 16, quick 8)")
    parser.add_argument("--d-model", type=int, default=None, help="model width (default 64, quick 32)")
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--max-chars", type=int, default=1_000_000, help="corpus bytes")
    parser.add_argument("--val-every", type=int, default=None, help="steps between validations (default S/10, quick S/2)")
    parser.add_argument("--val-batches", type=int, default=None, help="validation batches (default 8, quick 2)")


def add_start_method_arg(parser: argparse.ArgumentParser) -> None:
    """``--start-method`` of the multi-process runs."""
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "fork"),
                        help="how multi-process runs start their processes: spawn (as users do) or fork (skips "
                        "the ~10 s of imports per run on a loaded machine; changes no number but the wall-clock)")


def fill_run_defaults(args: argparse.Namespace) -> None:
    """Quick or full defaults for the options of :func:`add_run_args` (``args.steps`` must be set)."""
    q = args.quick
    args.batch_size = args.batch_size or (8 if q else 16)
    args.d_model = args.d_model or (32 if q else 64)
    args.val_every = args.val_every or max(args.steps // (2 if q else 10), 1)
    args.val_batches = args.val_batches or (2 if q else 8)


def run_spec(args: argparse.Namespace, lr: float, **model: object) -> RunSpec:
    """The :class:`RunSpec` of a script's arguments (``add_run_args``, ``--steps``, ``--world-size`` and an
    optional ``--workload``, default the char LM)."""
    workload = getattr(args, "workload", "char_lm")
    return RunSpec(
        lr=lr, steps=args.steps, seed=args.seed, devices=args.world_size, batch_size=args.batch_size,
        max_chars=args.max_chars, val_every=args.val_every, val_batches=args.val_batches,
        model={"d_model": args.d_model, "n_layers": args.n_layers, **model} if workload == "char_lm" else model,
        workload=workload,
    )


def hdet_callbacks(every_n_steps: int, vote: str = "pbt", signal: str = "mean", blend: str = "mean",
                   search_steps: int | None = None, refine_spread: float = 1.5, blend_strength: float = 1.0,
                   init_noise: float = 0.0, seed: int = 0, **softmax: float) -> list[Callback]:
    """The HDET callbacks of one benchmark arm from its flat names (the arms' labels and the results' columns
    keep 0.x's flat arguments): the vote object with its own options, ``experimental.PartialMerge`` for
    ``blend_strength`` and ``experimental.InitNoise`` for ``init_noise`` (benchmark 1's published arms)."""
    from lightning_hdet import PBT, Best, HDETCallback, Search, Softmax, experimental

    rules = {"softmax": lambda: Softmax(blend=blend, **softmax), "best": lambda: Best(blend=blend),
             "pbt": PBT}
    rule: object = rules[vote]() if vote in rules else vote  # another name: HDETCallback's error says which exist
    if blend_strength != 1.0:
        rule = experimental.PartialMerge(rule, strength=blend_strength)
    search = Search(steps=search_steps, refine_spread=refine_spread) if search_steps else False
    callbacks: list[Callback] = [HDETCallback(every_n_steps=every_n_steps, vote=rule, signal=signal, search=search,
                                              seed=seed)]
    return callbacks + ([experimental.InitNoise(init_noise, seed=seed)] if init_noise > 0 else [])
