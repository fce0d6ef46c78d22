"""Delayed Nesterov (DN): the outer optimizer of asynchronous Local-SGD.

Plain Nesterov momentum breaks when pseudo-gradients from several workers arrive one after another: each
push decays the momentum and adds a full momentum step. DN (Liu et al., arXiv 2401.09135) buffers the pushes
and updates the momentum only once every ``buffer_size`` pushes; in between, each push moves the parameters
by its own share ``-lr * g / N`` plus, optionally, a fraction ``c`` of the momentum step.

With ``momentum_activation = 0``, ``N`` pushes of the same ``g`` move the parameters exactly like one
``torch.optim.SGD(nesterov=True)`` step on ``g``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_hdet._checks import check_int, check_number


class DelayedNesterov(Optimizer):
    """Delayed Nesterov outer optimizer.

    ``param.grad`` holds the pseudo-gradient of one push (``theta_pulled - theta_local``). On every
    :meth:`step`, per parameter: ``delta += g``; on the ``N``-th push since the last momentum update
    ``m = momentum * m + delta / N`` and ``theta -= lr * ((1 - c*N + c) * momentum * m + g / N)``, then
    ``delta = 0``; otherwise ``theta -= lr * (c * momentum * m + g / N)``.

    Args:
        params: the parameters (the global model, usually host-memory tensors).
        lr: outer learning rate (> 0).
        momentum: momentum coefficient in [0, 1).
        buffer_size: ``N``, pushes per momentum update (>= 1); the natural choice is the number of workers.
        momentum_activation: ``c`` in ``[0, 1/N]``, the share of the momentum step applied on each
            intermediate push (0 = momentum only at the ``N``-th push, as published by default).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        buffer_size: int = 1,
        momentum_activation: float = 0.0,
    ) -> None:
        validate_outer_hyperparameters(lr, momentum, buffer_size, momentum_activation)
        defaults = dict(lr=lr, momentum=momentum, buffer_size=buffer_size, momentum_activation=momentum_activation)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one push (the pseudo-gradient in each parameter's ``.grad``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            n, c = group["buffer_size"], group["momentum_activation"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["delta"] = torch.zeros_like(p)
                    state["pushes"] = 0
                m, delta = state["momentum_buffer"], state["delta"]
                delta.add_(g)
                state["pushes"] += 1
                if state["pushes"] == n:
                    m.mul_(beta).add_(delta, alpha=1.0 / n)
                    p.add_(m, alpha=-lr * (1.0 - c * n + c) * beta)
                    delta.zero_()
                    state["pushes"] = 0
                elif c > 0:
                    p.add_(m, alpha=-lr * c * beta)
                p.add_(g, alpha=-lr / n)
        return loss


def validate_outer_hyperparameters(
    lr: float, momentum: float, buffer_size: int, momentum_activation: float
) -> None:
    """Raise a ValueError naming the argument when an outer-optimizer hyperparameter is out of range."""
    for name, value in (("outer_lr", lr), ("outer_momentum", momentum), ("momentum_activation", momentum_activation)):
        check_number(name, value)
    check_number("outer_lr", lr, low=0, low_open=True)
    check_number("outer_momentum", momentum, low=0, high=1, high_open=True)
    check_int("buffer_size", buffer_size, minimum=1)
    check_number("momentum_activation", momentum_activation, low=0, high=1.0 / buffer_size,
                 hint=f"(the upper end is 1/buffer_size, buffer_size={buffer_size})")
