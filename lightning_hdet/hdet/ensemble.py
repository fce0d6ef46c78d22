"""The model-state half of the HDET executor interface: gather, merge, restore, warm start, checkpoint the ensemble.

:class:`EnsembleOps` is mixed into :class:`~lightning_hdet.hdet.strategy.HDETStrategy` (a DDP strategy: every rank
holds a full replica, so a group's state is any of its ranks' flat vector). It reads the strategy's
``lightning_module``, ``layout``, ``group_index``, ``world_size``, ``root_device``, ``optimizers`` and
``lr_multipliers``, and owns one piece of state: the restore point (the last finite merge target, on the host).
A sharded strategy implements the same methods over its shards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_hdet._compat import unwrap_optimizer
from lightning_hdet._tensors import (
    all_finite,
    flat_dtype,
    flatten,
    host_buffer,
    host_copy,
    model_state,
    numel,
    read_into,
    reduced_buckets,
    sync_device,
    to_cpu,
    write_from,
)
from lightning_hdet.hdet.checkpoints import (
    group_dir,
    group_file,
    own_group_state,
    read_group_file,
    resharded,
    state_dict_with,
)

log = logging.getLogger(__name__)


class EnsembleOps:
    """Collectives and model-state operations the callback's decisions need (see the module docstring)."""

    _restore_point: Optional[Tensor]

    def gather_group_values(self, values: Tensor) -> Tensor:
        """Sum ``values`` (1-D, this rank's numbers) over the ranks of each group; return ``(num_groups, k)``.

        One small all-reduce over all ranks; every rank gets every group's row.
        """
        values = values.to(self.root_device, torch.float64).reshape(-1)
        table = torch.zeros(self.num_groups, values.numel(), dtype=torch.float64, device=self.root_device)
        table[self.group_index] = values
        if _distributed(self.world_size):
            dist.all_reduce(table)
        return table.cpu()

    def add_init_noise(self, relative_std: float, seed: int) -> None:
        """Published warm start: ``theta += eps``, ``eps ~ N(0, relative_std^2 |theta|^2 / d)`` from ``seed``."""
        params = list(self.lightning_module.parameters())
        flat = flatten(params).double()
        std = relative_std * float(flat.norm()) / math.sqrt(flat.numel())
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in params:
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * std).to(p.device, p.dtype))

    def merge(self, coefficients: Sequence[float], strengths: Sequence[float], restart: Sequence[bool]) -> None:
        """Blend the groups' parameters and floating-point buffers, one bucket of at most 25 MiB at a time.

        ``target = sum_g coefficients[g] * theta_g`` (all-reduces over all ranks, bucket by bucket, so a merge needs
        one bucket of extra device memory); each group moves ``theta_g <- (1 - strengths[g]) * theta_g +
        strengths[g] * target``. A group whose coefficient is 0 contributes zeros, so non-finite parameters of a
        diverged group never reach the target. A finite target becomes the restore point (written into the host
        copy bucket by bucket); the groups flagged in ``restart`` clear their optimizer state.
        """
        tensors = model_state(self.lightning_module)
        keep = self._contributions_finite(tensors, coefficients)
        if keep:
            self._restore_point = self._restore_buffer(tensors)
        strength = float(strengths[self.group_index])
        for bucket, flat in reduced_buckets(tensors, self._coefficient(coefficients), self._all_reduce):
            bucket.scatter(flat, strength)
            if keep:
                self._restore_point[bucket.offset : bucket.offset + bucket.numel].copy_(flat, non_blocking=True)
            del flat  # one bucket alive at a time
        sync_device(self.root_device)  # the host copy is read later: the non-blocking copies must have landed
        if restart[self.group_index]:
            self._clear_optimizer_state()
        log.debug("merge: coefficients %s, strengths %s", list(coefficients), list(strengths))

    def _coefficient(self, coefficients: Sequence[float]) -> float:
        return float(coefficients[self.group_index]) / self.layout.group_size

    def _all_reduce(self, flat: Tensor) -> None:
        if _distributed(self.world_size):
            dist.all_reduce(flat)

    def _contributions_finite(self, tensors: list[Tensor], coefficients: Sequence[float]) -> bool:
        """Whether every group with a non-zero coefficient holds finite values, i.e. the merge target will be
        finite: checked before any bucket is written, so the restore point is replaced only by a finite target
        (one small all-reduce and one host read per merge)."""
        finite = all_finite(tensors) if self._coefficient(coefficients) != 0.0 else torch.ones((), dtype=torch.bool)
        row = self.gather_group_values(finite.double().reshape(1))[:, 0]
        return all(float(n) == self.layout.group_size for n, c in zip(row, coefficients) if c != 0.0)

    def _restore_buffer(self, tensors: list[Tensor]) -> Tensor:
        """The host buffer of the restore point (reused; pinned on CUDA)."""
        size, dtype = numel(tensors), flat_dtype(tensors)
        held = self._restore_point
        if held is not None and held.numel() == size and held.dtype == dtype:
            return held
        return host_buffer(size, self.root_device, dtype)

    def ensure_restore_point(self) -> None:
        """Make the current model state the restore point unless one is held (from a merge or a checkpoint)."""
        if self._restore_point is None:
            tensors = model_state(self.lightning_module)
            self._restore_point = read_into(tensors, self._restore_buffer(tensors), self.root_device)

    def restore(self) -> None:
        """Roll back to the restore point; every group restarts its optimizer state."""
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        write_from(model_state(self.lightning_module), self._restore_point, self.root_device)
        self._clear_optimizer_state()
        log.debug("roll-back to the restore point")

    def _clear_optimizer_state(self) -> None:
        """A rescued group restarts its optimizer state (moments from the diverged region would mislead it)."""
        for optimizer in self.optimizers:
            optimizer.state.clear()

    # ------------------------------------------------------------------ checkpoints
    def save_ensemble(self) -> dict[str, Any]:
        """Multipliers, the number of per-group files and the restore point, for ``checkpoint["hdet"]``. The groups'
        own states are not in it: each group's leader writes its own file beside the checkpoint
        (``save_checkpoint``)."""
        return {
            "lr_multipliers": self.lr_multipliers,
            "group_files": self.num_groups if self.num_groups > 1 else None,
            "last_good": self._restore_point.cpu() if self._restore_point is not None else None,
        }

    def load_ensemble(self, state: dict[str, Any]) -> None:
        """Multipliers and restore point from ``checkpoint["hdet"]`` (the groups' states load with the model)."""
        self.set_lr_multipliers(state["lr_multipliers"])
        if state.get("last_good") is not None:
            self._restore_point = host_copy(state["last_good"])

    def own_state(self) -> dict[str, Any]:
        """This group's own parameters, buffers and optimizer states, on the host (what its leader writes)."""
        return {
            "state_dict": to_cpu(self.lightning_module.state_dict()),
            "optimizer_states": [to_cpu(unwrap_optimizer(opt).state_dict()) for opt in self.optimizers],
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Each group's first rank writes its group's own state beside the checkpoint; then rank 0 writes the
        checkpoint itself (the merged model), which therefore never names a file that is not there yet."""
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
        load = lambda: self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)  # noqa: E731
        hdet["own"] = read_group_file(load, checkpoint_path, path, self.num_groups)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model, on rank 0's host: the mean over groups whose parameters are finite, reduced to rank 0
        one bucket at a time (a collective on every rank). Other ranks return their own state dict, which
        Lightning does not write."""
        module = self.lightning_module
        if self.num_groups == 1 or not dist.is_initialized():
            return module.state_dict()
        tensors = model_state(module)
        healthy = self.gather_group_values(all_finite(tensors).double().reshape(1))[:, 0] == self.layout.group_size
        if not bool(healthy.any()):
            healthy = torch.ones_like(healthy)
        coefficient = self._coefficient((healthy.double() / healthy.sum()).tolist())
        merged = [torch.empty(t.shape, dtype=t.dtype) for t in tensors] if self.is_global_zero else None
        index = {id(t): i for i, t in enumerate(tensors)}
        for bucket, flat in reduced_buckets(tensors, coefficient, lambda x: dist.reduce(x, dst=0)):
            for t, start, stop, part in bucket.parts(flat) if merged is not None else ():
                merged[index[id(t)]].view(-1)[start:stop].copy_(part)
            del flat  # one bucket alive at a time
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


def _distributed(world_size: int) -> bool:
    return dist.is_available() and dist.is_initialized() and world_size > 1
