"""The model-state half of the HDET executor interface for sharded groups (``"hdet_fsdp"``).

:class:`ShardedEnsembleOps` is mixed into :class:`~lightning_hdet.hdet.fsdp.HDETFSDPStrategy`. It does what
:class:`~lightning_hdet.hdet.ensemble.EnsembleOps` does for full replicas, on this rank's shards: merges reduce the
local parameter shards across the mesh's group dimension (``across_groups``) and the unsharded float buffers over
all ranks; the restore point is this rank's part of the last finite merge target, on the host. It reads the
strategy's ``lightning_module``, ``layout``, ``group_index``, ``root_device``, ``optimizers``, ``across_groups``,
``shard_mesh`` and ``lr_multipliers``, and owns the restore point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet._tensors import assign_flat, flat_dtype, flatten, float_buffers, host_buffer, host_copy, numel
from lightning_hdet.hdet.shards import blend, local_shards, shard_state


class ShardedEnsembleOps:
    """Merge, restore, warm start and the ensemble part of a checkpoint, on local shards (see the module docstring)."""

    _restore_point: Optional[Tensor]

    def merge(
        self, coefficients: Sequence[float], strengths: Sequence[float], restart: Sequence[bool], keep: bool = True
    ) -> None:
        """``theta_g <- (1 - s_g) theta_g + s_g sum_h c_h theta_h``, shard by shard, in buckets of at most 25 MB.

        A group whose coefficient is 0 contributes zeros. A finite target becomes the restore point when ``keep``
        (the safety net judged the merge good; identical on every rank); the groups flagged in ``restart`` clear
        their optimizer state.
        """
        module = self.lightning_module
        shards, buffers = local_shards(module), float_buffers(module)
        coefficient, strength = float(coefficients[self.group_index]), float(strengths[self.group_index])
        target = host_buffer(numel(shards) + numel(buffers), self.root_device, flat_dtype(shards + buffers))
        blend(shards, coefficient, strength, self.across_groups, target[: numel(shards)])
        blend(buffers, coefficient / self.layout.group_size, strength, None, target[numel(shards):])
        if keep:
            # Every rank holds a different part of the target: the restore point moves only if all parts are finite.
            finite = torch.isfinite(target).all().to(self.root_device, torch.int32)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if bool(finite):
                self._restore_point = target
        if restart[self.group_index]:
            self._clear_optimizer_state()

    def ensure_restore_point(self) -> None:
        """Make this rank's current shards the restore point unless one is held (from a merge or a checkpoint)."""
        if self._restore_point is None:
            self._restore_point = host_copy(flatten(shard_state(self.lightning_module)))

    def restore(self) -> None:
        """Roll this rank's shards back to the restore point; every group restarts its optimizer state."""
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        assign_flat(shard_state(self.lightning_module), self._restore_point.to(self.root_device), 1.0)
        self._clear_optimizer_state()

    def _clear_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            optimizer.state.clear()

    @torch.no_grad()
    def add_init_noise(self, relative_std: float, seed: int) -> None:
        """Published warm start on shards: ``eps ~ N(0, relative_std^2 |theta|^2 / d)``, over the full model."""
        shards = local_shards(self.lightning_module)
        stats = torch.stack([sum((t.double().pow(2).sum() for t in shards), torch.zeros((), dtype=torch.float64,
                                                                                         device=self.root_device)),
                             torch.tensor(float(numel(shards)), dtype=torch.float64, device=self.root_device)])
        dist.all_reduce(stats, group=self.shard_mesh.get_group())
        std = relative_std * math.sqrt(float(stats[0]) / max(float(stats[1]), 1.0))
        # Each shard rank draws for its own slice of the group's parameters.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + self.shard_mesh.get_local_rank())
        for t in shards:
            t.add_((torch.randn(t.shape, generator=gen, dtype=torch.float64) * std).to(t.device, t.dtype))

    # ------------------------------------------------------------------ checkpoints
    def save_ensemble(self) -> dict[str, Any]:
        """Multipliers and this rank's restore point; every group's own state goes into the checkpoint folder."""
        return {
            "lr_multipliers": self.lr_multipliers,
            "groups": None,
            "last_good": self._restore_point,
        }

    def load_ensemble(self, state: dict[str, Any]) -> None:
        """Multipliers and restore point (this rank's, read from the folder by the strategy's ``load_checkpoint``)."""
        self.set_lr_multipliers(state["lr_multipliers"])
        if state.get("last_good") is not None:
            self._restore_point = host_copy(state["last_good"])
