"""The model-state half of the HDET executor interface for full replicas: warm start, checkpoint the ensemble.

:class:`EnsembleOps` is mixed into :class:`~lightning_hdet.hdet.lightning.strategy.HDETStrategy` (a DDP strategy: every
rank holds a full replica, so a group's state is any of its ranks' tensors). Merges, the restore point and roll-backs
come from the strategy's :class:`~lightning_hdet.hdet.execution.merge.Merger`, over what :class:`ReplicaSite` names: the
model's parameters and float buffers (and the base iterate of schedule-free optimizers). It reads the strategy's
``lightning_module``, ``layout``, ``group_index``, ``group_ranks``, ``world_size``, ``root_device``, ``optimizers``,
``checkpoint_io`` and ``lr_multipliers``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hdet._compat import unwrap_optimizer, weights_only_kwargs
from lightning_hdet._tensors import flatten, model_state, reduced_buckets, to_cpu
from lightning_hdet.hdet.execution.comm import GroupComm
from lightning_hdet.hdet.execution.merge import MergeOps, MergePart, StrategySite, iterate_states
from lightning_hdet.hdet.execution.validation import healthy_mean
from lightning_hdet.hdet.lightning.checkpoints import (
    group_dir,
    group_file,
    own_group_state,
    read_group_file,
    resharded,
    state_dict_with,
)


class ReplicaSite(StrategySite):
    """What a merge carries on a rank holding its group's full model (``"hdet"``)."""

    def merge_parts(self) -> list[MergePart]:
        """Every rank holds its group's full model: each contributes ``1 / group_size`` of it, summed over all ranks."""
        strategy = self.strategy
        return [MergePart(model_state(strategy.lightning_module), 1.0 / strategy.layout.group_size, None)]

    def iterate_part(self) -> MergePart:
        """Reduced as the parameters are."""
        strategy = self.strategy
        params = list(strategy.lightning_module.parameters())
        return MergePart(iterate_states(strategy.optimizers, params), 1.0 / strategy.layout.group_size, None)


@torch.no_grad()
def add_init_noise(params: list[Tensor], relative_std: float, seed: int) -> None:
    """Published warm start: ``theta += eps``, ``eps ~ N(0, relative_std^2 |theta|^2 / d)`` from a generator
    seeded ``seed`` (drawn in float64, parameter by parameter)."""
    flat = flatten(params).double()
    std = relative_std * float(flat.norm()) / math.sqrt(flat.numel())
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * std).to(p.device, p.dtype))


def merged_on_rank_zero(groups: GroupComm, tensors: list[Tensor], is_global_zero: bool) -> Optional[list[Tensor]]:
    """The mean of ``tensors`` over the groups whose tensors are finite
    (:func:`~lightning_hdet.hdet.execution.validation.healthy_mean`), on rank 0's host, reduced to rank 0 one bucket at
    a time through ``groups``' communicator (a collective on every rank); ``None`` on the other ranks."""
    coefficient = healthy_mean(groups, tensors)[groups.group_index] / groups.layout.group_size
    merged = [torch.empty(t.shape, dtype=t.dtype) for t in tensors] if is_global_zero else None
    index = {id(t): i for i, t in enumerate(tensors)}
    for bucket, flat in reduced_buckets(tensors, coefficient, lambda x: groups.comm.reduce(x, dst=0)):
        for t, start, stop, part in bucket.parts(flat) if merged is not None else ():
            merged[index[id(t)]].view(-1)[start:stop].copy_(part)
        del flat  # one bucket alive at a time
    return merged


class EnsembleOps(MergeOps):
    """Warm start and checkpoints of an ensemble of full replicas (see the module docstring)."""

    # The checkpoint's own optimizer states are rank 0's, not the groups' (those go to the group files, from the live
    # optimizers): HDETCallback scales their LRs to where the run ended, for a plain Lightning resume.
    saves_plain_lrs = True

    def add_init_noise(self, relative_std: float, seed: int) -> None:
        """Published warm start (:func:`add_init_noise`) on this rank's parameters."""
        add_init_noise(list(self.lightning_module.parameters()), relative_std, seed)

    # ------------------------------------------------------------------ checkpoints
    def ensemble_files(self) -> dict[str, Any]:
        """Where every group's own state is, for ``checkpoint["hdet"]``: the number of per-group files each group's
        first rank writes beside the checkpoint (``save_checkpoint``; ``None``: one group, the checkpoint is its
        state)."""
        return {"group_files": self.num_groups if self.num_groups > 1 else None}

    def own_state(self) -> dict[str, Any]:
        """This group's own parameters, buffers and optimizer states, on the host (what its first rank writes)."""
        return {
            "state_dict": to_cpu(self.lightning_module.state_dict()),
            "optimizer_states": [to_cpu(unwrap_optimizer(opt).state_dict()) for opt in self.optimizers],
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Each group's first rank writes its group's own state beside the checkpoint; then rank 0 writes the
        checkpoint itself (the merged model), which therefore never names a file that is not there yet."""
        # Rank 0's path: a name built from a metric each group measured itself (``HDETCallback(monitor=...)``, e.g.
        # ModelCheckpoint's ``{val_loss}``) differs between groups, and every group's file belongs beside one file.
        filepath = self.broadcast(filepath)
        if (checkpoint.get("hdet") or {}).get("group_files"):
            if self.global_rank == self.group_ranks[0]:
                self.checkpoint_io.save_checkpoint(self.own_state(), group_file(filepath, self.group_index))
            self.barrier("hdet_group_files")
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove the checkpoint and its per-group files (``ModelCheckpoint(save_top_k=...)`` rotates both)."""
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(group_dir(filepath))

    def attach_own_state(self, checkpoint: dict[str, Any], checkpoint_path: Any, weights_only: Optional[bool]) -> None:
        """Read this group's own file into ``checkpoint["hdet"]["own"]`` when the checkpoint was written by as many
        groups as this run has (each rank reads its own group's file only)."""
        hdet = checkpoint.get("hdet") or {}
        if hdet.get("group_files") != self.num_groups:
            return
        path = group_file(checkpoint_path, self.group_index)
        load = lambda: self.checkpoint_io.load_checkpoint(path, **weights_only_kwargs(weights_only))  # noqa: E731
        hdet["own"] = read_group_file(load, checkpoint_path, path, self.num_groups)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model, on rank 0's host: the mean over groups whose parameters are finite, reduced to rank 0
        one bucket at a time (a collective on every rank). Other ranks return their own state dict, which
        Lightning does not write."""
        module = self.lightning_module
        if self.num_groups == 1 or self.communicator.world_size() == 1:
            return module.state_dict()
        tensors = model_state(module)
        merged = merged_on_rank_zero(self.hdet.groups, tensors, self.is_global_zero)
        return module.state_dict() if merged is None else state_dict_with(module, tensors, merged)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after wrapping: DDP's initial broadcast would otherwise overwrite each group's own weights."""
        return True

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        own = own_group_state(checkpoint, self.num_groups, self.group_index)
        if own is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.lightning_module.load_state_dict(own["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        own = own_group_state(checkpoint, self.num_groups, self.group_index)
        if resharded(checkpoint, own):
            return  # another group count: fresh optimizer state for every group
        if own is None:
            return super().load_optimizer_state_dict(checkpoint)
        super().load_optimizer_state_dict({"optimizer_states": own["optimizer_states"]})
