"""Delayed Nesterov (DN, Liu et al., arXiv 2401.09135), asynchronous Local-SGD's outer optimizer, and Nesterov,
DiLoCo's. Plain Nesterov breaks when pushes arrive one after another (each decays the momentum and adds a full
momentum step); DN updates the momentum once every ``N`` pushes, and in between each push moves the parameters by
``-lr * g / N`` (plus a share ``c`` of the momentum step). With ``c = 0``, ``N`` pushes of one ``g`` step exactly
as ``torch.optim.SGD(nesterov=True)``; with ``N = 1`` it is DiLoCo's Nesterov with a momentum schedule
(:class:`MomentumSchedule`; why: :mod:`.momentum`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import KnownArguments, check_int, check_number, require
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.lookahead import LookaheadLR, refuse_lookahead


class DelayedNesterovOptimizer(KnownArguments, Optimizer):
    """Delayed Nesterov as a ``torch.optim.Optimizer`` (what :class:`DelayedNesterov` and :class:`Nesterov` build):
    per push ``g`` (``param.grad``), ``delta += g``; on the ``N``-th ``m = momentum * m + delta / N`` and ``theta -= lr
    * ((1 - c*N + c) * momentum * m + g / N)``, ``delta = 0``; otherwise ``theta -= lr * (c * momentum * m + g / N)``.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float, momentum: float = 0.9,
                 buffer_size: int = 1, momentum_activation: float = 0.0, momentum_warmup: int = 0,
                 momentum_restart: int = 0) -> None:
        validate_outer_hyperparameters(lr, momentum, buffer_size, momentum_activation)
        MomentumSchedule(momentum, momentum_warmup, momentum_restart)  # validates
        defaults = dict(lr=lr, momentum=momentum, buffer_size=buffer_size, momentum_activation=momentum_activation,
                        momentum_warmup=momentum_warmup, momentum_restart=momentum_restart)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one push (the pseudo-gradient in each parameter's ``.grad``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, n, c = group["lr"], group["buffer_size"], group["momentum_activation"]
            schedule = MomentumSchedule(group["momentum"], group.get("momentum_warmup", 0), group.get("momentum_restart", 0))
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, p.grad, lr, n, c, schedule)
        return loss

    def resize(self, size: int) -> bool:
        """Set ``N`` in each group at a momentum-update boundary; True if every group took it."""
        check_int("size", size, minimum=1)
        done = True
        for group in self.param_groups:
            if all(self.state.get(p, {}).get("pushes", 0) == 0 for p in group["params"]):
                group["buffer_size"] = size
            else:
                done = False
        return done

    def follow(self, live: int, ceiling: int | None = None) -> bool:
        """:meth:`resize` to ``live`` workers, at most ``ceiling`` (a ``buffer_size`` given), at least 1."""
        return self.resize(max(1, min(ceiling or live, live)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Also loads a ``torch.optim.SGD(nesterov=True)`` state (DiLoCo's before; ``N = 1``)."""
        groups = [{**{k: v for k, v in own.items() if k != "params"},
                   **{k: v for k, v in saved.items() if k in own}}
                  for own, saved in zip(self.param_groups, state_dict["param_groups"])]
        super().load_state_dict({**state_dict, "param_groups": groups})
        for group in self.param_groups:
            for p in group["params"]:
                self._fold_delta(self.state.get(p, {}), group)

    @staticmethod
    def _fold_delta(state: dict[str, Any], group: dict[str, Any]) -> None:
        """A state saved before pushes went straight into the momentum kept them in ``delta``: fold it in."""
        n, c = group["buffer_size"], group["momentum_activation"]
        if "delta" not in state or (c > 0 and n > 1):
            return
        delta, pushes = state.pop("delta"), state.get("pushes", 0)
        if pushes == 0:
            return
        schedule = MomentumSchedule(group["momentum"], group.get("momentum_warmup", 0), group.get("momentum_restart", 0))
        updates = state.get("updates", 0)
        m = state.get("momentum_buffer")
        if m is None or schedule.restarts(updates + 1):
            m = state["momentum_buffer"] = torch.zeros_like(delta)
        m.mul_(schedule.beta(updates + 1)).add_(delta, alpha=1.0 / n)

    def _step_one(self, p: torch.Tensor, g: torch.Tensor, lr: float, n: int, c: float,
                  schedule: MomentumSchedule) -> None:
        """One push on one parameter. Buffers only where read: no momentum buffer with momentum 0, no ``delta`` unless
        ``c > 0`` (with ``c = 0`` the momentum is read only at the ``N``-th push, so each push goes into it as it comes:
        one model of state, as DiLoCo's Nesterov). ``get`` with defaults: older or ``SGD`` states lack keys."""
        state = self.state[p]
        pushes, updates = state.get("pushes", 0) + 1, state.get("updates", 0)
        beta = schedule.beta(updates + 1)  # of the next momentum update
        last = pushes == n
        if schedule.momentum > 0:
            m = state.get("momentum_buffer")
            if m is None:
                m = state["momentum_buffer"] = torch.zeros_like(p)
            if c == 0 or n == 1:  # the push goes into the momentum as it comes (with N = 1 the same step)
                if pushes == 1:  # a cycle's first push
                    if schedule.restarts(updates + 1):
                        m.zero_()
                    m.mul_(beta)
                m.add_(g, alpha=1.0 / n)  # alpha 1.0 with N = 1: the same float32 sum as m + g
            else:  # c > 0: intermediate pushes read the last momentum, so the cycle's pushes wait in ``delta``
                delta = state.get("delta")
                if delta is None:
                    delta = state["delta"] = torch.zeros_like(p)
                delta.add_(g)
                if last:
                    if schedule.restarts(updates + 1):
                        m.zero_()
                    m.mul_(beta).add_(delta, alpha=1.0 / n)
                    delta.zero_()
                else:
                    p.add_(m, alpha=-lr * c * beta)
            if last:
                p.add_(m, alpha=-lr * (1.0 - c * n + c) * beta)
        if last:
            updates, pushes = updates + 1, 0
        p.add_(g, alpha=-lr / n)
        state["pushes"], state["updates"] = pushes, updates


def validate_outer_hyperparameters(lr: float, momentum: float, buffer_size: int, momentum_activation: float) -> None:
    """Refuse an outer-optimizer hyperparameter out of range, naming it (a non-number as such first)."""
    for name, value in (("lr", lr), ("momentum", momentum), ("momentum_activation", momentum_activation)):
        check_number(name, value)
    check_number("lr", lr, low=0, low_open=True, hint="The outer lr: 0.7 is DiLoCo's; see docs/async.md.")
    check_number("momentum", momentum, low=0, high=1, high_open=True)
    check_int("buffer_size", buffer_size, minimum=1)
    check_number("momentum_activation", momentum_activation, low=0, high=1.0 / buffer_size,
                 hint=f"(the upper end is 1/buffer_size, buffer_size={buffer_size})")


@dataclass(frozen=True)
class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov (in DiLoCo ``N = 1``: Nesterov with this momentum schedule); the ``"stable"``, ``"robust"``
    and ``"published"`` presets are this object.

    Args:
        lr: the outer learning rate (> 0; DiLoCo's 0.7).
        momentum: Nesterov momentum in [0, 1).
        warmup: momentum updates over which the momentum ramps up linearly from 0 (0: none).
        restarts: zero the momentum before every ``restarts``-th momentum update (0: never).
        buffer_size: async only: ``N``, pushes per momentum update; ``None``: the workers still training.
        momentum_activation: async only: ``c`` in ``[0, 1/N]``, the momentum step's share on other pushes.
        lookahead: a :class:`~.lookahead.LookaheadLR`: every outer update at the lr (from ``lr``) that scores best
            on validation batches; ``None`` (default): ``lr`` throughout.
    """

    lr: float
    momentum: float = 0.9
    warmup: int = 0
    restarts: int = 0
    buffer_size: Optional[int] = None
    momentum_activation: float = 0.0
    lookahead: Optional[LookaheadLR] = None

    def __post_init__(self) -> None:
        check_int("buffer_size", self.buffer_size, minimum=1, optional=True,
                  hint="Pushes per momentum update; None follows the workers still training.")
        validate_outer_hyperparameters(self.lr, self.momentum, self.buffer_size or 1, self.momentum_activation)
        MomentumSchedule(self.momentum, self.warmup, self.restarts)
        if self.lookahead is not None:
            require("lookahead", self.lookahead, isinstance(self.lookahead, LookaheadLR), "a LookaheadLR(...) or None")
            self.lookahead.check_lr(self.lr)
            if self.momentum > 0.5:  # measured: a one-step lookahead does not see momentum 0.9 carry a push on
                warnings.warn(f"DelayedNesterov(momentum={self.momentum}, lookahead=...): the lookahead was measured"
                              " stable at momentum 0.5 and rising at 0.9 (docs/async.md); use momentum=0.5.",
                              stacklevel=3)

    def check(self, mode: str, stagger: int) -> None:
        for name, value, default in (("buffer_size", self.buffer_size, None),
                                     ("momentum_activation", self.momentum_activation, 0)):
            require(name, value, mode == "async" or value == default,
                    f"{default} (the default) with mode='sync' (DiLoCo)",
                    "DiLoCo's outer step is one Nesterov step on the mean of every worker's push. Remove it.")

    def check_workers(self, workers: int) -> None:
        n = self.buffer_size or workers
        require("buffer_size", n, n <= workers, f"1..{workers} (the number of workers)", "Delayed Nesterov averages"
                " N pushes into one momentum update; N beyond one push per worker only delays momentum.")
        validate_outer_hyperparameters(self.lr, self.momentum, n, self.momentum_activation)

    def check_elastic(self) -> None:
        refuse_lookahead(self, "an elastic service", "The service holds no model to score candidates on.")
        require("momentum_activation", self.momentum_activation, self.momentum_activation == 0,
                "0 with an elastic service", "Delayed Nesterov's N follows the live workers, and c must stay <= 1/N.")

    def follows_live(self, mode: str) -> bool:
        return mode == "async"

    def optimizer(self, views: Sequence[Tensor], mode: str, workers: int) -> Optimizer:
        n = (self.buffer_size or workers) if mode == "async" else 1
        return DelayedNesterovOptimizer(views, lr=self.lr, momentum=self.momentum, buffer_size=n,
                                        momentum_activation=self.momentum_activation, momentum_warmup=self.warmup,
                                        momentum_restart=self.restarts)


@dataclass(frozen=True)
class Nesterov(OuterOptimizer):
    """DiLoCo's published Nesterov (lr 0.7, momentum 0.9), no schedule; async: each push a full step."""

    lr: float
    momentum: float = 0.9

    def __post_init__(self) -> None:
        validate_outer_hyperparameters(self.lr, self.momentum, 1, 0.0)

    def optimizer(self, views: Sequence[Tensor], mode: str, workers: int) -> Optimizer:
        return DelayedNesterovOptimizer(views, lr=self.lr, momentum=self.momentum)


@dataclass(frozen=True)
class MomentumSchedule:
    """``beta`` for the k-th momentum update (ramped over ``warmup``); restart every ``restart``-th."""

    momentum: float
    warmup: int = 0
    restart: int = 0

    def __post_init__(self) -> None:
        check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_int("warmup", self.warmup, minimum=0, hint="Momentum updates over which the momentum ramps up; 0: none.")
        check_int("restarts", self.restart, minimum=0, hint="The momentum restarts every this many updates; 0: never.")

    def beta(self, update: int) -> float:
        """``momentum * min(1, update / warmup)``."""
        return self.momentum * update / self.warmup if self.warmup and update < self.warmup else self.momentum

    def restarts(self, update: int) -> bool:
        return bool(self.restart) and update % self.restart == 0
