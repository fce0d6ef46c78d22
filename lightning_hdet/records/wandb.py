"""Logger glue shared by the HDET callback and the async strategy.

- :func:`record_config` puts a configuration into the run config under ``hdet/...`` / ``async/...``
  through ``log_hyperparams`` (W&B, CSV and TensorBoard loggers alike).
- :func:`vote_table` / :func:`log_vote_history`: the vote history as a ``wandb.Table`` for W&B and a
  plain list of rows (plus ``vote_history.csv`` in the log dir) for other loggers.
- :func:`finish_worker_run` keeps a W&B run that was started inside a forked worker from being lost.

Nothing here needs a W&B account or network; ``wandb`` is imported only when a ``WandbLogger`` is used.
"""

from __future__ import annotations

import csv
import multiprocessing
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.loggers import Logger, WandbLogger

from lightning_hdet._compat import wandb_run_created_in_this_process
from lightning_hdet.records.history import VOTE_CSV

if TYPE_CHECKING:
    import wandb
    from lightning.pytorch import Trainer

#: Columns of the vote history, in order (``lr``: the LR the vote set, from this vote on).
VOTE_COLUMNS = ("step", "group", "lr", "loss", "weight", "winner", "rescued")
#: The column after them, where rows have it (HDET's do): the LR the group started the interval at, from which it
#: reached the row's ``loss``; ``trained_<name>`` the same for each explored hyperparameter, after their columns.
TRAINED_LR = "trained_lr"
TRAINED = "trained_"
#: Key under which the vote history table is logged.
VOTE_TABLE_KEY = "hdet/vote/history"

VoteRow = Union[Mapping[str, Any], Sequence[Any]]


def _loggers(target: Trainer | Logger | Iterable[Logger]) -> list[Logger]:
    if isinstance(target, Logger):
        return [target]
    loggers = getattr(target, "loggers", None)
    return list(loggers) if loggers is not None else list(target)  # type: ignore[arg-type]


def _config_value(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    return str(value)


def flatten_config(prefix: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """``{"vote": {"sigma": 0.1}}`` under ``"hdet"`` → ``{"hdet/vote/sigma": 0.1}``; values made
    loggable (enums by value, sequences as lists, other objects as ``str``)."""
    if not prefix or prefix.strip("/") != prefix:
        raise ValueError(
            f"prefix={prefix!r} must be a non-empty name without leading/trailing '/', e.g. 'hdet'"
        )
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(name, value))
        else:
            flat[name] = _config_value(value)
    return flat


def record_config(
    trainer: Trainer | Logger | Iterable[Logger], prefix: str, config: Mapping[str, Any]
) -> dict[str, Any]:
    """Record ``config`` under ``<prefix>/...`` in every logger's hyperparameters / run config.

    Goes through ``Logger.log_hyperparams`` so it works for ``WandbLogger`` (run config),
    ``CSVLogger`` (``hparams.yaml``) and ``TensorBoardLogger``; safe to call on every rank (loggers
    write on rank 0 only). Never touch ``logger.experiment.config`` directly instead: on ranks > 0 of a
    ``ddp`` (subprocess) launch the experiment is a dummy and ``.config.update`` raises.
    Returns the flat dict that was recorded.
    """
    flat = flatten_config(prefix, config)
    for logger in _loggers(trainer):
        logger.log_hyperparams(flat)
    return flat


def _vote_row(row: VoteRow) -> list[Any]:
    if isinstance(row, Mapping):
        missing = [c for c in VOTE_COLUMNS if c not in row]
        if missing:
            raise ValueError(f"vote row {dict(row)!r} lacks {missing}; allowed columns: {list(VOTE_COLUMNS)}")
        values = [row[c] for c in VOTE_COLUMNS]
    else:
        values = list(row)
        if len(values) != len(VOTE_COLUMNS):
            raise ValueError(f"vote row {values!r} has {len(values)} values; expected {list(VOTE_COLUMNS)}")
    step, group, lr, loss, weight, winner, rescued = values
    return [int(step), int(group), float(lr), float(loss), float(weight), int(winner), bool(rescued)]


def explored_columns(rows: Iterable[VoteRow]) -> list[str]:
    """The other explored hyperparameters a vote history holds (``HDETStrategy(explore=...)``): one more column
    each, after :data:`VOTE_COLUMNS`, with every group's new value (as ``lr``)."""
    names: dict[str, None] = {}
    for row in rows:
        if isinstance(row, Mapping):
            names.update(dict.fromkeys(row.get("explored") or {}))
    return list(names)


def extra_columns(rows: Sequence[VoteRow]) -> list[str]:
    """The columns after :data:`VOTE_COLUMNS`: :data:`TRAINED_LR` where a row has it, the explored
    hyperparameters' and, where rows hold what they trained at, their ``trained_<name>``."""
    maps = [r for r in rows if isinstance(r, Mapping)]
    names = explored_columns(maps)
    trained = [TRAINED + n for n in names if any(n in (r.get("trained_explored") or {}) for r in maps)]
    return ([TRAINED_LR] if any(TRAINED_LR in r for r in maps) else []) + names + trained


def _full_row(row: VoteRow, extra: Sequence[str]) -> list[Any]:
    row_map = row if isinstance(row, Mapping) else {}
    values = {TRAINED_LR: row_map.get(TRAINED_LR, float("nan")), **(row_map.get("explored") or {}),
              **{TRAINED + n: v for n, v in (row_map.get("trained_explored") or {}).items()}}
    return _vote_row(row) + [float(values.get(n, float("nan"))) for n in extra]


def vote_rows(rows: Iterable[VoteRow]) -> list[dict[str, Any]]:
    """The vote history as plain dicts with :data:`VOTE_COLUMNS` and :func:`extra_columns` (the non-W&B form)."""
    rows = list(rows)
    extra = extra_columns(rows)
    return [dict(zip(list(VOTE_COLUMNS) + extra, _full_row(r, extra))) for r in rows]


def vote_table(rows: Iterable[VoteRow]) -> wandb.Table:
    """The vote history as a ``wandb.Table`` with :data:`VOTE_COLUMNS` and :func:`extra_columns`; one row per
    (vote, group)."""
    import wandb

    rows = list(rows)
    extra = extra_columns(rows)
    return wandb.Table(columns=list(VOTE_COLUMNS) + extra, data=[_full_row(r, extra) for r in rows])


def log_vote_history(trainer: Trainer | Logger | Iterable[Logger], rows: Sequence[VoteRow],
                     step: int | None = None) -> list[dict[str, Any]]:
    """Log the vote history: a ``wandb.Table`` under ``hdet/vote/history`` for each ``WandbLogger``,
    ``vote_history.csv`` in the ``log_dir`` of each other logger that has one. Call on rank 0 (it
    writes files); returns the plain rows."""
    plain = vote_rows(rows)
    for logger in _loggers(trainer):
        path = _vote_csv(logger)
        if isinstance(logger, WandbLogger):
            logger.log_metrics({VOTE_TABLE_KEY: vote_table(rows)}, step=step)  # type: ignore[dict-item]
        elif path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=list(plain[0]) if plain else VOTE_COLUMNS)
                writer.writeheader()
                writer.writerows(plain)
    return plain


def _vote_csv(logger: Logger) -> Path | None:
    """The ``vote_history.csv`` a logger other than W&B gets (``None``: it has no ``log_dir``)."""
    log_dir = None if isinstance(logger, WandbLogger) else getattr(logger, "log_dir", None)
    return Path(log_dir) / VOTE_CSV if log_dir else None


def vote_history_locations(trainer: Trainer | Logger | Iterable[Logger]) -> list[str]:
    """Where :func:`log_vote_history` puts the vote table for these loggers: W&B's table key, the CSV paths."""
    places = []
    for logger in _loggers(trainer):
        path = _vote_csv(logger)
        if isinstance(logger, WandbLogger):
            places.append(f"W&B table {VOTE_TABLE_KEY!r}")
        elif path is not None:
            places.append(str(path))
    return places


def finish_worker_run(trainer: Trainer) -> bool:
    """Finish a W&B run that rank 0 created inside a forked worker (``ddp_fork`` / ``ddp_notebook``).

    Such a worker ends without running W&B's exit hooks, and a run it started itself is then lost
    (state "unknown", no history). Runs created before ``fit`` in the main process, attached ones
    (``ddp_spawn``) and runs of ``ddp`` subprocess launches are left alone. Call from ``teardown``;
    returns whether a run was finished.
    """
    if not trainer.is_global_zero or multiprocessing.parent_process() is None:
        return False
    finished = False
    for logger in trainer.loggers:
        run = wandb_run_created_in_this_process(logger)
        if run is not None:
            run.finish()
            finished = True
    return finished
