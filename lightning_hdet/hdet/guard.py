"""Detecting non-finite steps without host synchronisation inside the backward pass.

:class:`FiniteGuard` is a DDP communication hook: for each gradient bucket it records (as a device tensor, so no
host sync) whether the rank's *local* gradient is finite, replaces a non-finite bucket with zeros so it cannot
poison the other ranks' average, then averages the bucket exactly as DDP's built-in reduction does
(multiply by ``1 / world_size``, then all-reduce), so a run without any non-finite value is bit-identical to DDP.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer


class FiniteGuard:
    """State of the finite-gradient DDP communication hook (one per DDP model)."""

    # No ``from __future__ import annotations`` here: DDP checks the hook's annotations at registration.
    def __init__(self, process_group: Any, size: int, device: torch.device) -> None:
        self.process_group = process_group
        self.size = size
        self.flag = torch.zeros((), dtype=torch.bool, device=device)

    def reset(self) -> None:
        self.flag.zero_()

    @staticmethod
    def hook(state: "FiniteGuard", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        bad = ~torch.isfinite(buffer).all()
        torch.logical_or(state.flag, bad, out=state.flag)
        buffer.mul_(1.0 / state.size)
        buffer.masked_fill_(bad, 0.0)
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


def grads_are_finite(optimizer: Optimizer) -> Tensor:
    """Whether every gradient the optimizer would apply is finite (a device tensor, no host sync)."""
    grads = [p.grad for pg in optimizer.param_groups for p in pg["params"] if p.grad is not None]
    if not grads:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([torch.isfinite(g).all() for g in grads]).all()


class SkipStep(Exception):
    """Raised from inside the closure to skip an optimizer step before it touches any state."""


def guarded_closure(
    closure: Callable[[], Any],
    optimizer: Optimizer,
    guard: Optional[FiniteGuard],
    check_grads: bool,
    group: Any,
    group_size: int,
    device: torch.device,
) -> Callable[[], Any]:
    """Wrap an optimizer closure: raise :class:`SkipStep` when the loss or the gradients are non-finite on any rank
    of this rank's group (``group``), so the whole group skips the step together.

    ``guard``: the DDP hook's flag (local gradients before the average); without one, ``check_grads`` checks the
    averaged gradients (off under a grad scaler, which skips non-finite steps itself).
    """

    def closure_with_guard() -> Any:
        result = closure()
        bad = torch.zeros((), dtype=torch.bool, device=device)
        if isinstance(result, Tensor):
            bad |= ~torch.isfinite(result.detach()).all()
        if guard is not None:
            bad |= guard.flag
        elif check_grads:
            bad |= ~grads_are_finite(optimizer)
        if group_size > 1:
            flag = bad.to(torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            bad = flag.bool()
        if bool(bad):  # the one host sync of a guarded step: whether to step at all
            raise SkipStep
        return result

    return closure_with_guard
