"""Reshard a worker's inner optimizer state from ``k_old`` FSDP2 shards to ``k_new`` (pure), for a run resumed with
another ``ranks_per_worker``: FSDP2 shards dim 0 in chunks of ``ceil(n / k)`` rows and per-parameter state tensors
follow their parameter, so the old shards concatenated are the whole state and a new rank takes its rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def shard_rows(n: int, shards: int, index: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of ``n`` that shard ``index`` of ``shards`` holds (the last ones may be empty)."""
    if not 0 <= index < shards:
        raise ValueError(f"`index={index}` must be in [0, {shards}) (`shards={shards}`)")
    size = math.ceil(n / shards)
    lo = min(index * size, n)
    return lo, min(lo + size, n)


def reshard_entry(values: Sequence[Any], shards: int, index: int) -> Any:
    """Shard ``index`` of one state entry from its old shards ``values`` (a scalar: shard 0's)."""
    if not (isinstance(values[0], Tensor) and values[0].dim() > 0):
        return values[0]
    if any(not isinstance(v, Tensor) or v.shape[1:] != values[0].shape[1:] for v in values):
        raise ValueError(f"the {len(values)} old shards of a state tensor do not agree beyond dim 0: "
                         f"{[tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in values]}")
    full = torch.cat(list(values), dim=0)
    lo, hi = shard_rows(full.shape[0], shards, index)
    return full[lo:hi].clone()


def reshard_optimizer_state(old: Sequence[dict[str, Any]], shards: int, index: int) -> dict[str, Any]:
    """Shard ``index`` of ``shards`` of a worker's optimizer state from its old ranks' ``old``."""
    if not old:
        raise ValueError("`old` must hold at least one shard's optimizer state")
    keys = [set(o["state"]) for o in old]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"the {len(old)} old shards hold state for different parameters: {[sorted(k) for k in keys]}")
    state = {i: {name: reshard_entry([o["state"][i][name] for o in old], shards, index) for name in entry}
             for i, entry in old[0]["state"].items()}
    return {**old[0], "state": state}
