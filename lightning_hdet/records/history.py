"""A run's logged scalars read back into one table, and what it says (votes, rescues, async rounds).

Pure: no matplotlib, no Lightning. The HDET callback and the async strategy fill a :class:`History` live on rank
0; :func:`load_history` reads one back from a ``CSVLogger`` directory, a ``TensorBoardLogger`` one or a W&B
offline run, and fills in what the ``vote_history.csv`` beside it holds (or reads that file alone).
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_hdet.records.tensorboard import find_event_files, read_scalars

GROUP_LR = re.compile(r"^hdet/group(\d+)/lr$")
GROUP_LOSS = re.compile(r"^hdet/group(\d+)/loss$")
VOTE_WEIGHT = re.compile(r"^hdet/vote/weight(\d+)$")
VOTE_WINNER = "hdet/vote/winner"
MEAN_LR = "hdet/mean_lr"
RESCUES = "hdet/rescues"
WORKER_KEY = re.compile(r"^async/worker(\d+)/(\w+)$")
_WANDB_STEP = "trainer/global_step"
#: File name of the vote history written beside a non-W&B logger's files (one row per vote and group).
VOTE_CSV = "vote_history.csv"


@dataclass
class History:
    """A run's logged scalars as a tidy table: ``rows[step][key] = value``.

    Rows logged at the same step are merged (a later value for the same key wins), which undoes
    CSVLogger's one-row-per-logging-call layout. A callback can also fill one live with :meth:`add`.
    """

    rows: dict[int, dict[str, float]] = field(default_factory=dict)

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the numeric entries of ``metrics`` at ``step``; other values are skipped."""
        row = self.rows.setdefault(int(step), {})
        for key, value in metrics.items():
            number = _as_float(value)
            if number is not None:
                row[key] = number

    def fill(self, other: History) -> None:
        """Take the values of ``other`` for the (step, key) pairs this history lacks."""
        for step, row in other.rows.items():
            mine = self.rows.setdefault(step, {})
            for key, value in row.items():
                mine.setdefault(key, value)

    @property
    def keys(self) -> set[str]:
        """Every key logged at least once."""
        return set().union(*self.rows.values()) if self.rows else set()

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps (ascending) at which ``key`` was logged and its values there."""
        points = sorted((step, row[key]) for step, row in self.rows.items() if key in row)
        return [s for s, _ in points], [v for _, v in points]

    def indices(self, pattern: re.Pattern[str]) -> list[int]:
        """Sorted group/worker indices that occur as the first capture of ``pattern``."""
        return sorted({int(m.group(1)) for key in self.keys if (m := pattern.match(key))})


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # 0-d tensors / numpy scalars
        value = value.item()
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # CSV cells, and W&B's JSON spelling of NaN/Infinity
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_history(run: str | os.PathLike[str]) -> History:
    """Load a run's metrics from a CSVLogger directory (or its ``metrics.csv``), a TensorBoardLogger directory (or
    an ``events.out.tfevents.*`` file), a W&B run, or a ``vote_history.csv`` alone.

    A W&B run is a ``run-*.wandb`` file, an ``offline-run-*`` / ``run-*`` directory holding one, or a
    ``wandb`` directory (its ``latest-run`` is used). A ``vote_history.csv`` beside the metrics fills in the vote
    keys they lack. Nothing is sent over the network.
    """
    path = Path(run)
    if not path.exists():
        raise ValueError(
            f"run={str(run)!r} does not exist; pass a CSVLogger, TensorBoardLogger or W&B run directory"
        )
    if path.name == VOTE_CSV:
        return load_vote_history(path)
    wandb_file = _find_wandb_file(path)
    if wandb_file is not None:
        return load_wandb_history(wandb_file)
    csv_file = _find_metrics_csv(path)
    events = find_event_files(path) if csv_file is None else []
    if csv_file is None and not events:
        raise ValueError(
            f"run={str(run)!r} holds no CSVLogger metrics.csv, TensorBoard event file, W&B run-*.wandb file or "
            f"{VOTE_CSV}; allowed: a CSVLogger or TensorBoardLogger log dir (e.g. lightning_logs/version_0), its "
            f"metrics.csv or events.out.tfevents.* file, a wandb/offline-run-* directory or its run-*.wandb file, "
            f"a {VOTE_CSV}"
        )
    history = load_csv_history(csv_file) if csv_file is not None else load_tensorboard_history(events)
    votes = (csv_file or events[0]).parent / VOTE_CSV
    if votes.is_file():
        history.fill(load_vote_history(votes))
    return history


def load_tensorboard_history(event_files: list[Path]) -> History:
    """Read the scalars of a TensorBoardLogger run's event files."""
    history = History()
    for step, tag, value in read_scalars(event_files):
        history.add(step, {tag: value})
    return history


def load_vote_history(vote_csv: str | os.PathLike[str]) -> History:
    """The vote keys (every group's new LR and loss, the weights, the winner, the cumulative rescues) rebuilt from
    a ``vote_history.csv`` (columns ``step, group, lr, loss, weight, winner, rescued``)."""
    history, rescues = History(), 0
    with open(vote_csv, newline="") as file:
        for record in csv.DictReader(file):
            step, group = int(record["step"]), int(record["group"])
            rescues += record["rescued"] == "True"
            history.add(step, {f"hdet/group{group}/lr": record["lr"], f"hdet/group{group}/loss": record["loss"],
                               f"hdet/vote/weight{group}": record["weight"], VOTE_WINNER: record["winner"],
                               RESCUES: rescues})
    return history


def _find_metrics_csv(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".csv" else None
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    found = sorted(path.glob("**/metrics.csv"))
    if len(found) > 1:
        raise ValueError(f"run={str(path)!r} holds several metrics.csv files ({found}); pass one of them")
    return found[0] if found else None


def _find_wandb_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".wandb" else None
    if (path / "latest-run").is_dir():
        path = (path / "latest-run").resolve()
    found = sorted(path.glob("run-*.wandb"))
    if len(found) > 1:
        raise ValueError(f"run={str(path)!r} holds several .wandb files ({found}); pass one of them")
    return found[0] if found else None


def load_csv_history(metrics_csv: str | os.PathLike[str]) -> History:
    """Read a CSVLogger ``metrics.csv`` (sparse columns, one row per logging call, a ``step`` column)."""
    history = History()
    with open(metrics_csv, newline="") as file:
        for record in csv.DictReader(file):
            step = record.pop("step", "")
            if step == "":
                continue
            history.add(int(float(step)), {k: v for k, v in record.items() if v not in ("", None)})
    return history


def load_wandb_history(wandb_file: str | os.PathLike[str]) -> History:
    """Read the history records of a W&B transaction log (``run-*.wandb``), offline.

    Uses W&B's own documented reader, ``wandb leet inspect --json`` (one JSON object per record), run
    with the current interpreter's ``wandb`` in offline mode. Steps are ``trainer/global_step`` (what
    Lightning's WandbLogger logs against) and W&B's ``_step`` where that is absent.
    """
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    history = History()
    for line in result.stdout.splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") != "history":
            continue
        item = record["history"].get("item", {})
        step = item.get(_WANDB_STEP, record["history"].get("step", {}).get("num", item.get("_step")))
        if step is None:
            continue
        history.add(int(step), {k: v for k, v in item.items() if not k.startswith("_") and k != _WANDB_STEP})
    return history


def _vote_signature(row: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((k, v) for k, v in row.items()
                        if k.startswith("hdet/vote/") or GROUP_LOSS.match(k)))


def votes(history: History) -> tuple[list[int], list[int]]:
    """Steps of the distinct votes and their winners.

    ``LightningModule.log(on_step=True)`` re-emits a key's last value at every later step, so a row
    repeating the previous vote exactly (winner, weights and group losses) is the same vote, not a new one.
    """
    steps, winners, previous = [], [], None
    for step in history.series(VOTE_WINNER)[0]:
        signature = _vote_signature(history.rows[step])
        if signature != previous:
            steps.append(step)
            winners.append(int(history.rows[step][VOTE_WINNER]))
        previous = signature
    return steps, winners


def rescues(history: History) -> list[int]:
    """Steps at which the cumulative ``hdet/rescues`` count went up."""
    steps, counts = history.series(RESCUES)
    return [s for i, s in enumerate(steps) if counts[i] > (counts[i - 1] if i else 0.0)]


@dataclass(frozen=True)
class Round:
    """One logged round of an async worker."""

    step: int
    compute_s: float
    wait_s: float
    staleness: float | None


def worker_rounds(history: History, worker: int) -> list[Round]:
    """The distinct rounds of ``worker``: consecutive log entries with identical (compute_s, wait_s)
    repeat the same "last round" and are counted once."""
    prefix = f"async/worker{worker}/"
    rounds: list[Round] = []
    for step in sorted(history.rows):
        row = history.rows[step]
        if prefix + "compute_s" not in row or prefix + "wait_s" not in row:
            continue
        compute, wait = row[prefix + "compute_s"], row[prefix + "wait_s"]
        if rounds and (rounds[-1].compute_s, rounds[-1].wait_s) == (compute, wait):
            continue
        rounds.append(Round(step, compute, wait, row.get(prefix + "staleness")))
    return rounds
