"""What an HDET checkpoint holds besides Lightning's own keys, and how each group finds its own state in it.

``checkpoint["state_dict"]`` is the merged model (so the file loads in plain Lightning); ``checkpoint["hdet"]``
holds every group's own parameters and optimizer states (``groups``), the multiplier table, the restore point and
the interrupted interval's loss sums, so a resume continues the ensemble exactly.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module


def own_group_state(checkpoint: dict[str, Any], num_groups: int, group_index: int) -> Optional[dict[str, Any]]:
    """This group's own ``{"state_dict", "optimizer_states"}``, or ``None`` (no ensemble, or another group count)."""
    groups = (checkpoint.get("hdet") or {}).get("groups")
    if not groups:
        return None
    if len(groups) != num_groups:
        rank_zero_warn(
            f"The checkpoint holds {len(groups)} HDET groups but this run has {num_groups}; every group "
            "starts from the checkpoint's merged model and a fresh optimizer state."
        )
        return None
    return groups[group_index]


def resharded(checkpoint: dict[str, Any], own: Optional[dict[str, Any]]) -> bool:
    """A checkpoint of an ensemble with another number of groups: every group starts a fresh optimizer state."""
    return own is None and bool((checkpoint.get("hdet") or {}).get("groups"))


def state_dict_with(module: Module, tensors: list[Tensor], flat: Tensor) -> dict[str, Any]:
    """``module.state_dict()`` with ``tensors`` (its parameters and float buffers) replaced by slices of ``flat``."""
    merged: dict[int, Tensor] = {}
    offset = 0
    for t in tensors:
        merged[id(t)] = flat[offset : offset + t.numel()].view_as(t).to(t.dtype).clone()
        offset += t.numel()
    return {k: merged.get(id(v), v.detach()) for k, v in module.state_dict(keep_vars=True).items()}
