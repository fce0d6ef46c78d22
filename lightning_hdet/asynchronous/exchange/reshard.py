"""Reshard a worker's inner optimizer state from ``k_old`` FSDP2 shards to ``k_new`` (pure: no process groups, no
Lightning; unit-tested against hand-computed tensors).

Why: with ``inside_worker="fsdp"`` each rank checkpoints only its own rows of its worker's inner optimizer state.
A run resumed with another ``ranks_per_worker`` gives each rank other rows of every parameter, so a rank cannot
load any one old file as it is (another rank's file, or its own written with another ``k``, holds the wrong rows).
FSDP2 shards every parameter along dim 0 (``Shard(0)``: chunks of ``ceil(n / k)`` rows, the last ranks' shorter or
empty), and an optimizer's per-parameter state tensors (Adam's ``exp_avg``, ...) have their parameter's layout: the
old shards, concatenated along dim 0, are the whole state, and the new rank's rows of it are its new shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def shard_rows(n: int, shards: int, index: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a dim 0 of ``n`` rows that shard ``index`` of ``shards`` holds (FSDP2's ``Shard(0)``;
    ``torch.chunk`` returns fewer than ``shards`` chunks when rows run out, FSDP2 gives the last ranks empty ones)."""
    if not 0 <= index < shards:
        raise ValueError(f"`index={index}` must be in [0, {shards}) (`shards={shards}`)")
    size = math.ceil(n / shards)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def _sharded(values: Sequence[Any]) -> bool:
    """A state entry that FSDP2 shards: a tensor with a dim 0 (scalars such as Adam's ``step`` are whole on every
    rank)."""
    return isinstance(values[0], Tensor) and values[0].dim() > 0


def reshard_entry(values: Sequence[Any], shards: int, index: int) -> Any:
    """One state entry of one parameter: ``values`` its ``k_old`` shards (in rank order); shard ``index`` of
    ``shards`` of it (a sharded tensor: its rows of the dim-0 concatenation; anything else: shard 0's)."""
    if not _sharded(values):
        return values[0]
    if any(not isinstance(v, Tensor) or v.shape[1:] != values[0].shape[1:] for v in values):
        raise ValueError(f"the {len(values)} old shards of a state tensor do not agree beyond dim 0: "
                         f"{[tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in values]}")
    full = torch.cat(list(values), dim=0)
    lo, hi = shard_rows(full.shape[0], shards, index)
    return full[lo:hi].clone()


def reshard_optimizer_state(old: Sequence[dict[str, Any]], shards: int, index: int) -> dict[str, Any]:
    """Shard ``index`` of ``shards`` of a worker's optimizer state dict, from ``old``: the state dicts its ``k_old``
    ranks saved (each with its own rows, as :func:`~.worker_shards.local_state` writes them), in rank order.

    The param groups (hyperparameters, the same on every rank) and every unsharded entry come from ``old[0]``. The
    worker's whole state is held for a moment (the concatenation) -- the price of a resume with another ``k``.
    """
    if not old:
        raise ValueError("`old` must hold at least one shard's optimizer state")
    keys = [set(o["state"]) for o in old]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"the {len(old)} old shards hold state for different parameters: {[sorted(k) for k in keys]}")
    state = {i: {name: reshard_entry([o["state"][i][name] for o in old], shards, index) for name in entry}
             for i, entry in old[0]["state"].items()}
    return {**old[0], "state": state}
