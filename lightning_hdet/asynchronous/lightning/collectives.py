"""A DDPStrategy whose collectives are answered locally while the workers train apart.

During asynchronous (or DiLoCo) training the workers are at different step counts, so Lightning's per-step
collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``, ``reduce_boolean_decision``) cannot meet;
while :attr:`LocalCollectivesStrategy.training_apart` is True each one returns its local answer, and the world size
reads 1 so that Lightning's loops issue none. Outside training they are DDP's.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override


class LocalCollectivesStrategy(DDPStrategy):
    """DDPStrategy with local collectives while :attr:`training_apart`; only rank 0 decides meanwhile."""

    #: True while the workers train apart (set by the subclass).
    training_apart = False

    @property
    @override
    def world_size(self) -> int:
        """1 while workers train independently, so that Lightning's loops issue no per-step collectives."""
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
        """While the workers train apart only rank 0 decides; its stop decision reaches the workers via the exchange."""
        if self.training_apart:
            return bool(decision) and self.is_global_zero
        return super().reduce_boolean_decision(decision, all)
