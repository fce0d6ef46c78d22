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
from lightning_hdet._tensors import assign_flat, flatten, host_copy, model_state, to_cpu
from lightning_hdet.hdet.checkpoints import own_group_state, resharded, state_dict_with

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
        """Blend the groups' parameters and floating-point buffers.

        ``target = sum_g coefficients[g] * theta_g`` (one all-reduce of the model's size over all ranks); then each
        group moves ``theta_g <- (1 - strengths[g]) * theta_g + strengths[g] * target``. A group whose coefficient is
        0 contributes zeros, so non-finite parameters of a diverged group never reach the target. A finite target
        becomes the restore point; the groups flagged in ``restart`` clear their optimizer state.
        """
        tensors = model_state(self.lightning_module)
        target = self._blend_target(tensors, coefficients)
        assign_flat(tensors, target, float(strengths[self.group_index]))
        if bool(torch.isfinite(target).all()):
            self._restore_point = host_copy(target, self._restore_point)
        if restart[self.group_index]:
            self._clear_optimizer_state()
        log.debug("merge: coefficients %s, strengths %s", list(coefficients), list(strengths))

    def _blend_target(self, tensors: list[Tensor], coefficients: Sequence[float]) -> Tensor:
        coefficient = float(coefficients[self.group_index]) / self.layout.group_size
        flat = flatten(tensors)
        if coefficient == 0.0:
            flat.zero_()
        else:
            flat.mul_(coefficient)
        if _distributed(self.world_size):
            dist.all_reduce(flat)
        return flat

    def ensure_restore_point(self) -> None:
        """Make the current model state the restore point unless one is held (from a merge or a checkpoint)."""
        if self._restore_point is None:
            self._restore_point = host_copy(flatten(model_state(self.lightning_module)))

    def restore(self) -> None:
        """Roll back to the restore point; every group restarts its optimizer state."""
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        assign_flat(model_state(self.lightning_module), self._restore_point.to(self.root_device), 1.0)
        self._clear_optimizer_state()
        log.debug("roll-back to the restore point")

    def _clear_optimizer_state(self) -> None:
        """A rescued group restarts its optimizer state (moments from the diverged region would mislead it)."""
        for optimizer in self.optimizers:
            optimizer.state.clear()

    # ------------------------------------------------------------------ checkpoints
    def save_ensemble(self) -> dict[str, Any]:
        """Multipliers, every group's own state (rank 0; a collective) and the restore point, for ``checkpoint["hdet"]``."""
        return {
            "lr_multipliers": self.lr_multipliers,
            "groups": self.ensemble_state() if self.num_groups > 1 else None,
            "last_good": self._restore_point.cpu() if self._restore_point is not None else None,
        }

    def load_ensemble(self, state: dict[str, Any]) -> None:
        """Multipliers and restore point from ``checkpoint["hdet"]`` (the groups' states load with the model)."""
        self.set_lr_multipliers(state["lr_multipliers"])
        if state.get("last_good") is not None:
            self._restore_point = host_copy(state["last_good"])

    def ensemble_state(self) -> Optional[list[dict[str, Any]]]:
        """Every group's own parameters and optimizer states, gathered on rank 0 (``None`` elsewhere)."""
        mine = None
        if self.global_rank == self.group_ranks[0]:
            mine = {
                "state_dict": {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()},
                "optimizer_states": [to_cpu(unwrap_optimizer(opt).state_dict()) for opt in self.optimizers],
            }
        gathered: Optional[list[Any]] = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(mine, gathered, dst=0)
        if not self.is_global_zero:
            return None
        return [gathered[self.layout.ranks(g)[0]] for g in range(self.num_groups)]  # type: ignore[index]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model: the mean over groups whose parameters are finite (a collective on every rank)."""
        module = self.lightning_module
        if self.num_groups == 1 or not dist.is_initialized():
            return module.state_dict()
        tensors = model_state(module)
        finite = torch.tensor([float(bool(torch.isfinite(flatten(tensors)).all()))])
        healthy = self.gather_group_values(finite)[:, 0] > 0
        if not bool(healthy.any()):
            healthy = torch.ones_like(healthy)
        target = self._blend_target(tensors, (healthy.double() / healthy.sum()).tolist())
        return state_dict_with(module, tensors, target)

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
