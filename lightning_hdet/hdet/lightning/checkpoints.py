"""What an HDET checkpoint holds besides Lightning's own keys, where each group's own state lives, and how a group
finds it.

``checkpoint["state_dict"]`` is the merged model (so the file loads in plain Lightning); ``checkpoint["hdet"]``
holds the multiplier table, the restore point, the interrupted interval's loss sums and ``group_files``: how many
groups wrote their own parameters and optimizer states beside the checkpoint, one file each,
``<checkpoint>.hdet/group<g>.pt`` (written by the group's first rank, read by the group's ranks only, so rank 0
never holds another group's state). A resume with the same number of groups continues the ensemble exactly.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module

from lightning_hdet.hdet.console import rounded_list


def group_dir(checkpoint_path: Any) -> str:
    """The folder of the per-group files beside ``checkpoint_path``."""
    return f"{checkpoint_path}.hdet"


def group_file(checkpoint_path: Any, group: int) -> str:
    """Group ``group``'s own state beside ``checkpoint_path``. A symbolic link (``ModelCheckpoint(save_last="link")``)
    is followed to the checkpoint it names, whose files these are."""
    path = str(checkpoint_path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    return f"{group_dir(path)}/group{group}.pt"


def read_group_file(
    load: Callable[[], dict[str, Any]], checkpoint_path: Any, path: str, num_groups: int
) -> dict[str, Any]:
    """``load()`` the group file ``path``, with an error that says what to do when it is missing."""
    try:
        return load()
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"The HDET checkpoint {str(checkpoint_path)!r} was written by {num_groups} groups, each with its own state "
            f"in {group_dir(checkpoint_path)!r}, but {path!r} is missing. Copy the `.hdet` folder along with the "
            "checkpoint, or resume with another `num_groups` (every group then starts from the merged model)."
        ) from err


def own_group_state(checkpoint: dict[str, Any], num_groups: int, group_index: int) -> Optional[dict[str, Any]]:
    """This group's own ``{"state_dict", "optimizer_states"}``, or ``None`` (no ensemble, or another group count)."""
    hdet = checkpoint.get("hdet") or {}
    count = int(hdet.get("group_files") or 0)
    if not count:
        return None
    if count != num_groups:
        rank_zero_warn(
            f"The checkpoint holds {count} HDET groups but this run has {num_groups}; every group "
            "starts from the checkpoint's merged model and a fresh optimizer state at your optimizer's (or "
            f"schedule's) LR{ended_at(checkpoint)}"
        )
        return None
    return hdet["own"]


def ended_at(checkpoint: dict[str, Any]) -> str:
    """What a warning adds about the LRs the checkpoint's run ended at (its optimizers' LRs while they are still
    scaled for a plain resume, :func:`save_plain_lrs`), or ``"."``: a run with another group count does not start
    there, and the user should know where it was."""
    if (checkpoint.get("hdet") or {}).get(PLAIN_KEY) is None:
        return "."
    lrs = [pg["lr"] for state in checkpoint.get("optimizer_states") or [] for pg in state.get("param_groups", [])
           if isinstance(pg.get("lr"), (int, float))]
    return (f"; the run ended at lr={rounded_list(lrs)} (per param group): set it as your LR to start there, or resume "
            "with the same number of groups to continue the search.") if lrs else "."


def resharded(checkpoint: dict[str, Any], own: Optional[dict[str, Any]]) -> bool:
    """A checkpoint of an ensemble with another number of groups: every group starts a fresh optimizer state."""
    return own is None and bool((checkpoint.get("hdet") or {}).get("group_files"))


def state_dict_with(module: Module, tensors: list[Tensor], values: list[Tensor]) -> dict[str, Any]:
    """``module.state_dict()`` with ``tensors`` (its parameters and float buffers) replaced by ``values``."""
    merged = {id(t): v for t, v in zip(tensors, values)}
    return {k: merged.get(id(v), v.detach()) for k, v in module.state_dict(keep_vars=True).items()}


# The multipliers (per flattened param group) by which a checkpoint's optimizer and scheduler LRs were scaled to the
# LRs the run ended at, so that a plain Lightning resume (no HDET) continues there; an HDET resume divides them out.
PLAIN_KEY = "plain_lr_multipliers"


def scale_saved_lrs(checkpoint: dict[str, Any], multipliers: list[float]) -> None:
    """Multiply the LRs ``checkpoint`` holds for each flattened param group by its multiplier, in place: every
    optimizer's ``lr`` and ``initial_lr`` (a scheduler's start) and, with one optimizer, every scheduler's
    ``base_lrs`` and ``_last_lr`` (a scheduler's param groups are its optimizer's; with several optimizers the
    checkpoint does not say which scheduler is whose, and those are left as they are)."""
    groups = [pg for state in checkpoint.get("optimizer_states") or [] for pg in state.get("param_groups", [])]
    if len(multipliers) < len(groups):
        multipliers = list(multipliers) + [multipliers[0]] * (len(groups) - len(multipliers))
    for pg, m in zip(groups, multipliers):
        for key in ("lr", "initial_lr"):
            if isinstance(pg.get(key), (int, float)):
                pg[key] = pg[key] * m
    if len(checkpoint.get("optimizer_states") or []) != 1:
        return
    for scheduler in checkpoint.get("lr_schedulers") or []:
        for key in ("base_lrs", "_last_lr"):
            values = scheduler.get(key)
            if isinstance(values, list) and all(isinstance(v, (int, float)) for v in values):
                scheduler[key] = [v * m for v, m in zip(values, multipliers)]


def save_plain_lrs(checkpoint: dict[str, Any], multipliers: Tensor, winner: int) -> None:
    """Scale the checkpoint's LRs to the last ``winner``'s row of the ``multipliers`` table (the groups' mean row
    without one): the saved model is the merged one, and its LRs go with it for a plain Lightning resume."""
    row = (multipliers[winner] if 0 <= winner < multipliers.shape[0] else multipliers.mean(0)).tolist()
    scale_saved_lrs(checkpoint, row)
    checkpoint["hdet"][PLAIN_KEY] = row


def restore_schedule_lrs(checkpoint: dict[str, Any]) -> None:
    """Undo :func:`save_plain_lrs` on a checkpoint HDET resumes (it applies its multipliers itself), once: Lightning
    restores the optimizers and schedulers from this same dict afterwards."""
    state = checkpoint.get("hdet") or {}
    if state.get(PLAIN_KEY) is not None:
        scale_saved_lrs(checkpoint, [1.0 / m for m in state[PLAIN_KEY]])
        state[PLAIN_KEY] = None
