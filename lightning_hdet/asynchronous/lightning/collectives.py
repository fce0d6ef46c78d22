"""A DDPStrategy whose collectives are answered locally while the workers train apart: they are at different step
counts, so Lightning's per-step collectives could not meet. Outside training they are DDP's."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override


class LocalCollectivesStrategy(DDPStrategy):
    """DDPStrategy with local collectives while :attr:`training_apart` (set by the subclass); rank 0 decides."""

    training_apart = False

    @property
    @override
    def world_size(self) -> int:
        """1 while workers train apart, so Lightning's loops issue no collectives."""
        return 1 if self.training_apart else super().world_size

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.training_apart:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self.training_apart else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor if self.training_apart else super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor if self.training_apart else super().all_gather(tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """While training apart only rank 0 decides; its stop reaches the workers through the exchange."""
        if self.training_apart:
            return bool(decision) and self.is_global_zero
        return super().reduce_boolean_decision(decision, all)
