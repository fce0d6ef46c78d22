"""Detecting non-finite steps on the device: no host synchronisation in the backward pass or the optimizer step.

:class:`FiniteGuard` is a DDP communication hook: for each gradient bucket it records (as a device tensor, so no
host sync) whether the rank's *local* gradient is finite, replaces a non-finite bucket with zeros so it cannot
poison the other ranks' average, then averages the bucket (multiply by ``1 / world_size``, then all-reduce), so a
run without any non-finite value is bit-identical to DDP at a power-of-two world size.
:class:`NonFiniteSteps` turns the flags into a skipped (or neutralised) optimizer step, still on the device.

Finiteness is read from one sum per bucket or gradient (:func:`finite`), not from ``isfinite(x).all()``: a sum is
non-finite exactly when an element is non-finite or the values overflow together, and it reads the memory once
without writing a boolean copy (12-30x faster on a CPU, measured; on a GPU one reduction instead of two kernels).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._tensors import all_finite, finite, local
from lightning_hdet.hdet.execution.comm import Communicator


class FiniteGuard:
    """State of the finite-gradient DDP communication hook (one per DDP model): the bucket's mean over
    ``process_group`` (``size`` ranks) goes through ``comm``."""

    # No ``from __future__ import annotations`` here: DDP checks the hook's annotations at registration.
    def __init__(self, process_group: Any, size: int, device: torch.device, comm: Communicator) -> None:
        self.process_group = process_group
        self.size = size
        self.comm = comm
        self.flag = torch.zeros((), dtype=torch.bool, device=device)

    def reset(self) -> None:
        self.flag.zero_()

    @staticmethod
    def hook(state: "FiniteGuard", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        ok = finite(buffer)
        torch.logical_or(state.flag, ok.logical_not(), out=state.flag)
        buffer.mul_(1.0 / state.size)
        # Zero a non-finite bucket without a host branch: x * False is 0, or NaN where x was not finite, then 0.
        # (A 0-d masked_fill_ reads like this but costs 15x a multiply on a CPU, measured.)
        buffer.mul_(ok).nan_to_num_(0.0, 0.0, 0.0)
        return state.comm.all_reduce_future(buffer, state.process_group)


def grads_are_finite(optimizer: Optimizer) -> Tensor:
    """Whether every gradient the optimizer would apply is finite (a device tensor, no host sync)."""
    # A sharded (DTensor) gradient is checked on this rank's shard: the caller combines the ranks' verdicts.
    return all_finite([local(p.grad) for pg in optimizer.param_groups for p in pg["params"] if p.grad is not None])


def skips_on_device(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` can skip a step on the device: torch's fused Adam, AdamW, SGD and Adagrad read a
    ``found_inf`` tensor (as under torch's GradScaler) and then leave parameters and state untouched, step count
    included."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class NonFiniteSteps:
    """Flags optimizer steps whose loss or gradients are non-finite, on the device: no host sync per step.

    What a flagged step does depends on the optimizer (see :func:`skips_on_device`):

    * **exact skip**, on the device: the flag, agreed within the group, is the optimizer's ``found_inf``;
    * **deferred**: any other optimizer steps with the gradient the guard left. The DDP hook replaced non-finite
      contributions by zeros before the average (without the hook, a non-finite averaged gradient is zeroed), so
      nothing non-finite reaches the parameters, but the optimizer state still moves (momentum, weight decay, step
      count). Skipping instead would need the flag on the host every step, i.e. a device-to-host sync per step;
      the vote rescues the flagged group anyway (merged back, optimizer state restarted).

    ``count`` sums flagged steps on the device; :meth:`total` and :meth:`interval` bring it to the host (a host
    sync: at votes and checkpoints, never per step). The group's ranks agree on the flag through ``comm``.
    """

    def __init__(self, device: torch.device, comm: Communicator) -> None:
        self.comm = comm
        self.flag = torch.zeros((), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.float32, device=device)
        self._total = 0  # host side: flagged steps up to the last read
        self._at_reset = 0

    def total(self) -> int:
        """Flagged steps since this object was made."""
        self._total += int(self.count.item())
        self.count.zero_()
        return self._total

    def interval(self, reset: bool = True) -> int:
        """Flagged steps since the last reset; ``reset=False`` only peeks."""
        count = self.total() - self._at_reset
        if reset:
            self._at_reset = self._total
        return count

    @contextmanager
    def found_inf(self, optimizer: Optimizer) -> Iterator[None]:
        """Hand the flag to ``optimizer`` as ``found_inf`` for one step (GradScaler's protocol), then take it back."""
        optimizer.found_inf = self.flag  # type: ignore[attr-defined]
        try:
            yield
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]

    def wrap(self, closure: Callable[[], Any], optimizer: Optimizer, guard: Optional[FiniteGuard], check_grads: bool,
             group: Any, group_size: int, exact: bool) -> Callable[[], Any]:
        """``closure`` followed by the check. ``guard``: the DDP hook's flag (local gradients before the average);
        without one, ``check_grads`` checks the averaged gradients (off under a grad scaler, which skips non-finite
        steps itself). ``exact``: the optimizer skips on the flag, so the group's ranks agree on it first."""

        def closure_with_check() -> Any:
            result = closure()
            # The flag is written in place, a handful of 0-d device ops per step (each one a launch on a GPU).
            if guard is not None:
                self.flag.copy_(guard.flag)
            elif check_grads:
                grads_bad = grads_are_finite(optimizer).logical_not_()
                if not exact:  # the same averaged gradient on every rank of the group: they all zero it alike
                    zero_grads(optimizer, grads_bad)
                self.flag.copy_(grads_bad)
            else:
                self.flag.zero_()
            if isinstance(result, Tensor):
                torch.logical_or(self.flag, finite(result.detach()).logical_not_(), out=self.flag)
            if exact and group_size > 1:  # a tiny all-reduce, queued on the device like the step itself
                self.comm.all_reduce(self.flag, group, op="max")
            self.count.add_(self.flag)
            return result

        return closure_with_check


@torch.no_grad()
def zero_grads(optimizer: Optimizer, bad: Tensor) -> None:
    """Replace every gradient by zeros where the device flag ``bad`` is set (no host sync)."""
    keep = bad.logical_not()
    for pg in optimizer.param_groups:
        for p in pg["params"]:
            if p.grad is not None:  # a DTensor's local shard: written in place; x * False, then NaN -> 0 (see hook)
                local(p.grad).mul_(keep).nan_to_num_(0.0, 0.0, 0.0)


class StepGuard:
    """The safety net's guard of one rank's optimizer steps, owned by the strategy (``strategy.hdet.guard``).

    Off until :meth:`enable` (the callback's ``setup(stage="fit")``, before the model is wrapped: the gradient hook
    is installed while wrapping). On, the strategy checks every step through :meth:`counter` (a
    :class:`NonFiniteSteps`, on the device) and keeps in ``hook`` the state of the gradient hook it installed (a
    :class:`FiniteGuard` or the sharded strategy's mean, whose ``flag`` says a local gradient was not finite), or
    ``None``. Its step check agrees within a group through ``comm``.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.enabled = False
        self.hook: Optional[Any] = None
        self._steps: Optional[NonFiniteSteps] = None

    def enable(self) -> None:
        """Flag (and, where the optimizer can, skip on the device) the steps whose loss or gradients are not finite."""
        self.enabled = True

    def counter(self, device: torch.device) -> NonFiniteSteps:
        """The step check and its device counter (made on the first guarded step)."""
        if self._steps is None:
            self._steps = NonFiniteSteps(device, self.comm)
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Steps flagged on this rank since the strategy started (reads the device counter)."""
        return self._steps.total() if self._steps is not None else 0

    def interval_skipped(self, reset: bool = True) -> int:
        """Flagged steps since the last reset (or the start of fit); ``reset=False`` only peeks. One host read of
        the device counter: called at votes and checkpoints, never per step."""
        return self._steps.interval(reset) if self._steps is not None else 0
