"""Checkpoints of ``"hdet_fsdp"``: one torch.distributed.checkpoint folder, written by every rank in parallel.

Layout (the keys of the folder's tensors; the rest of Lightning's checkpoint goes to ``meta.pt`` as for
Lightning's own ``ModelParallelStrategy``):

* ``model``: the merged model (mean over the groups whose parameters are finite), sharded like the training
  model; Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` turns it into the
  ``state_dict`` of a file that plain Lightning loads;
* ``hdet_group<g>``: group ``g``'s own ``model`` and ``optimizer_<i>`` states, each written by that group's ranks
  (nothing is gathered to rank 0), for an exact resume;
* ``hdet_backup.rank<r>``: each rank's part of the safety net's last good merged model.

Saving with the same keys from several ranks is deduplicated by torch.distributed.checkpoint, so the merged model
is written once although every group holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._compat import DCP_METADATA_FILENAME, unwrap_optimizer
from lightning_hdet._tensors import all_finite, numel
from lightning_hdet.hdet.execution.comm import Communicator
from lightning_hdet.hdet.fsdp.shards import local_shards, shard_state


@torch.no_grad()
def merged_state(
    model: Module, num_groups: int, across_groups: Any, shard_group: Any, group_size: int, comm: Communicator
) -> dict[str, Any]:
    """The model's state dict with every floating-point entry replaced by the mean over the healthy groups
    (:func:`healthy_merge`, through ``comm``)."""
    state = get_model_state_dict(model)
    if num_groups == 1:
        return state
    return healthy_merge(state, local_shards(model), num_groups, (across_groups, shard_group, group_size), comm)


@torch.no_grad()
def healthy_merge(state: dict[str, Any], shards: list[Tensor], num_groups: int, groups: tuple[Any, Any, int],
                  comm: Communicator) -> dict[str, Any]:
    """``state`` with every floating-point entry replaced by the mean over the groups whose ``shards`` (this
    rank's local parameter shards) are finite on every rank of the group (every group when none is).

    ``groups``: ``(across_groups, shard_group, group_size)``, the ranks holding the same shard in every group, the
    ranks of this rank's group and their number. Parameters stay sharded DTensors (their local shards are averaged
    over ``across_groups``); other entries (buffers) are averaged over all ranks. One extra copy of this rank's
    shard of the model, on its device; one host read of the health count (at a checkpoint, not per step).
    """
    across_groups, shard_group, group_size = groups
    finite = all_finite(shards).to(torch.float64)
    comm.all_reduce(finite, shard_group, op="min")  # a group is healthy if all its shards are ...
    ok = finite.clone()
    comm.all_reduce(ok, across_groups)  # ... and the target averages the healthy groups (all if none)
    coefficient = float(finite / ok) if float(ok) > 0 else 1.0 / num_groups
    merged: dict[str, Any] = {}
    for name, t in state.items():
        if isinstance(t, DTensor):
            part = _scaled(t.to_local(), coefficient)
            comm.all_reduce(part, across_groups)
            merged[name] = DTensor.from_local(part, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                              stride=t.stride())
        elif torch.is_floating_point(t):
            part = _scaled(t, coefficient / group_size)
            comm.all_reduce(part)
            merged[name] = part
        else:
            merged[name] = t
    return merged


def _scaled(t: Tensor, coefficient: float) -> Tensor:
    """``coefficient * t``; exact zeros for a coefficient of 0, so an excluded group's NaN never reaches the sum
    (``0 * nan`` is ``nan``)."""
    return torch.zeros_like(t) if coefficient == 0.0 else t * coefficient


def own_optimizer_state(model: Module, optimizer: Optimizer) -> dict[str, Any]:
    """This group's sharded optimizer state, keyed by parameter name."""
    return get_optimizer_state_dict(model, unwrap_optimizer(optimizer))


def save(checkpoint: dict[str, Any], path: Path, model: Module, group_index: int, global_rank: int) -> None:
    """Write ``checkpoint`` (Lightning's dict, with the merged ``state_dict``) as a distributed checkpoint folder
    (``global_rank``: this rank's, naming its backup; rank 0 writes the rest of Lightning's dict)."""
    own = {"model": get_model_state_dict(model)}
    own.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    state: dict[str, Any] = {"model": checkpoint.pop("state_dict"), f"hdet_group{group_index}": own}
    hdet = checkpoint.get("hdet")
    if hdet is not None and hdet.get("last_good") is not None:
        # Each rank's backup is its own shard of the last good merge: saved by each rank, never rank 0's for all.
        state[f"hdet_backup.rank{global_rank}"] = hdet.pop("last_good")
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=path)
    if global_rank == 0:
        torch.save(checkpoint, path / DCP_METADATA_FILENAME)


def load(
    path: Path,
    model: Module,
    optimizers: Sequence[Optimizer],
    group_index: int,
    num_groups: int,
    global_rank: int,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load this group's own state (or, with another number of groups, the merged model); return the rest."""
    if not (path / DCP_METADATA_FILENAME).is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint folder written by HDETFSDPStrategy (no {DCP_METADATA_FILENAME} in it)."
        )
    meta = torch.load(path / DCP_METADATA_FILENAME, weights_only=weights_only)
    hdet = meta.get("hdet") or {}
    model_state = get_model_state_dict(model)
    if hdet.get("num_groups") == num_groups:
        key = f"hdet_group{group_index}"
        optim = {f"optimizer_{i}": own_optimizer_state(model, o) for i, o in enumerate(optimizers)}
        state: dict[str, Any] = {key: {"model": model_state, **optim}}
        state.update(_backup_request(path, model, global_rank))
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state[key]["model"])
        for i, o in enumerate(optimizers):
            set_optimizer_state_dict(model, unwrap_optimizer(o), optim_state_dict=state[key][f"optimizer_{i}"])
        hdet["last_good"] = next((v for k, v in state.items() if k.startswith("hdet_backup")), None)
        return meta
    if hdet.get("num_groups") is not None:
        rank_zero_warn(
            f"The checkpoint holds {hdet['num_groups']} HDET groups but this run has {num_groups}; every group "
            "starts from the checkpoint's merged model and a fresh optimizer state."
        )
    dcp.load({"model": model_state}, checkpoint_id=path)
    set_model_state_dict(model, model_state)
    return meta


def _backup_request(path: Path, model: Module, global_rank: int) -> dict[str, Any]:
    """This rank's saved backup, if the checkpoint has one for it of the right size (same layout)."""
    key = f"hdet_backup.rank{global_rank}"
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.get(key)
    size = numel(shard_state(model))
    if saved is None or tuple(saved.size) != (size,):
        return {}
    return {key: torch.empty(size, dtype=saved.properties.dtype)}
