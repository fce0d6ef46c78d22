"""The model-state half of the HDET executor interface for sharded groups (``"hdet_fsdp"``).

:class:`ShardedEnsembleOps` is mixed into :class:`~lightning_hdet.hdet.fsdp.strategy.HDETFSDPStrategy`. Merges, the
restore point and roll-backs come from the strategy's :class:`~lightning_hdet.hdet.execution.merge.Merger`, over what
:class:`ShardSite` names, this rank's part of the model:
the local parameter shards, reduced across the mesh's group dimension (``across_groups``: never a full
parameter), then the unsharded float buffers, reduced over all ranks, then the local shards of schedule-free
optimizers' base iterate (not restored: a roll-back restarts the optimizer); the restore point is this rank's part of
the last good merge target, on the host. It reads the strategy's ``lightning_module``, ``layout``,
``group_index``, ``root_device``, ``optimizers``, ``across_groups``, ``shard_mesh`` and ``lr_multipliers``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_hdet._tensors import float_buffers, numel
from lightning_hdet.hdet.execution.merge import MergeOps, MergePart, StrategySite, iterate_states
from lightning_hdet.hdet.fsdp.shards import local_shards


class ShardSite(StrategySite):
    """What a merge carries on a rank holding its group's shard of the model (``"hdet_fsdp"``)."""

    def merge_parts(self) -> list[MergePart]:
        """The same shard of every group meets across the groups; buffers (replicated) over all ranks."""
        strategy = self.strategy
        module = strategy.lightning_module
        return [MergePart(local_shards(module), 1.0, strategy.across_groups),
                MergePart(float_buffers(module), 1.0 / strategy.layout.group_size, None)]

    def iterate_part(self) -> MergePart:
        """The same shard of every group's iterate meets across the groups, as the parameters' shards do."""
        strategy = self.strategy
        return MergePart(iterate_states(strategy.optimizers, list(strategy.lightning_module.parameters())), 1.0,
                         strategy.across_groups)


class ShardedEnsembleOps(MergeOps):
    """Warm start and the ensemble part of a checkpoint, on local shards (see the module docstring)."""

    @torch.no_grad()
    def add_init_noise(self, relative_std: float, seed: int) -> None:
        """Published warm start on shards: ``eps ~ N(0, relative_std^2 |theta|^2 / d)``, over the full model."""
        shards = local_shards(self.lightning_module)
        stats = torch.stack([sum((t.double().pow(2).sum() for t in shards), torch.zeros((), dtype=torch.float64,
                                                                                         device=self.root_device)),
                             torch.tensor(float(numel(shards)), dtype=torch.float64, device=self.root_device)])
        self.communicator.all_reduce(stats, self.shard_mesh.get_group())
        std = relative_std * math.sqrt(float(stats[0]) / max(float(stats[1]), 1.0))
        # Each shard rank draws for its own slice of the group's parameters.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + self.shard_mesh.get_local_rank())
        for t in shards:
            t.add_((torch.randn(t.shape, generator=gen, dtype=torch.float64) * std).to(t.device, t.dtype))

    # ------------------------------------------------------------------ checkpoints
    def ensemble_files(self) -> dict[str, Any]:
        """None: every group's own state is in the checkpoint folder itself (its DCP shards)."""
        return {}
