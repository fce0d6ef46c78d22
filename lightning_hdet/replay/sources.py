"""Where a finished HDET run keeps what a replay needs: its vote history and its initial multipliers.

* a ``CSVLogger`` (or TensorBoard) log directory, or the ``vote_history.csv`` in it: the rows the callback (or
  ``HDETLoop.finish``) wrote, and ``hparams.yaml`` beside it, where the run config holds ``hdet/lr_multipliers``;
* a checkpoint: a Trainer checkpoint's ``HDETCallback`` state or a Fabric checkpoint's ``HDETLoop`` state (their
  ``history``); it does not hold the initial multipliers, so pass them;
* a run that explored other hyperparameters (``HDETStrategy(explore=...)``) has one more vote-history column per
  name, and its run config ``hdet/explore/<name>``: every group's initial multiplier of it;
* the rows themselves (``callback.history``, ``hdet_loop.history``).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import yaml

VOTE_FILE = "vote_history.csv"
MULTIPLIERS_KEY = "hdet/lr_multipliers"

EXPLORE_KEY = "hdet/explore/"  # + a name: every group's initial multiplier of an explored hyperparameter

Source = Union[str, "os.PathLike[str]", Sequence[Mapping[str, Any]]]
#: Every group's multiplier when training started: the LR's, or ``{"lr": [...], "weight_decay": [...], ...}``.
Initial = Union[Sequence[float], Mapping[str, Sequence[float]]]


def load_run(source: Source, initial_multipliers: Optional[Initial] = None
             ) -> tuple[list[Mapping[str, Any]], list[float], dict[str, list[float]]]:
    """The vote-history rows, the initial LR multipliers and those of the other explored hyperparameters (by name)
    of the run ``source`` (see the module docstring)."""
    beside: Optional[dict[str, list[float]]] = None
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix in (".ckpt", ".pt", ".pth"):
            rows = _checkpoint_rows(path)
        else:
            csv_file = _vote_file(path)
            with open(csv_file, newline="") as file:
                rows = list(csv.DictReader(file))
            beside = _config_multipliers(csv_file.parent / "hparams.yaml")
    else:
        rows = list(source)
    given = dict(initial_multipliers) if isinstance(initial_multipliers, Mapping) else (
        None if initial_multipliers is None else {"lr": initial_multipliers})
    initial = given if given is not None else beside or {}
    multipliers = initial.get("lr")
    if multipliers is None:
        raise ValueError(f"`initial_multipliers` is needed for source={_name(source)}: it holds no run config with "
                         f"{MULTIPLIERS_KEY!r}. Pass the strategy's multipliers when training started (one per "
                         "group, e.g. `lightning_hdet.fan_out(num_groups, spread)`).")
    explored = {n: [float(m) for m in v] for n, v in initial.items() if n != "lr"}
    return rows, [float(m) for m in multipliers], explored


def _vote_file(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob(f"**/{VOTE_FILE}"))
    if len(found) != 1:
        raise ValueError(f"source={str(path)!r} must be a run's log dir holding exactly one {VOTE_FILE}, a "
                         f"{VOTE_FILE}, or a checkpoint (.ckpt, .pt, .pth); found {[str(f) for f in found]}.")
    return found[0]


def _config_multipliers(hparams: Path) -> Optional[dict[str, list[float]]]:
    """``{"lr": ..., <explored name>: ...}`` from the run config (``None``: no config, or no LR multipliers)."""
    if not hparams.is_file():
        return None
    config = yaml.safe_load(hparams.read_text()) or {}
    value = config.get(MULTIPLIERS_KEY)
    if value is None:
        return None
    explored = {k[len(EXPLORE_KEY):]: [float(v) for v in m] for k, m in config.items() if k.startswith(EXPLORE_KEY)}
    return {"lr": [float(v) for v in value], **explored}


def _checkpoint_rows(path: Path) -> list[Mapping[str, Any]]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # the user's own run's file
    candidates = list(checkpoint.values()) + list((checkpoint.get("callbacks") or {}).values())
    for state in candidates:
        if isinstance(state, Mapping) and "history" in state and "last_vote_step" in state:
            return list(state["history"])
    raise ValueError(f"source={str(path)!r} holds no HDETCallback or HDETLoop state (a vote history); replay from "
                     "a checkpoint of an HDET run, or from its log dir.")


def _name(source: Source) -> str:
    return repr(str(source)) if isinstance(source, (str, os.PathLike)) else f"<{len(source)} vote rows>"
