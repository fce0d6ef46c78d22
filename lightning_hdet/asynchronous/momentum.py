"""The outer momentum's schedule: warm-up and periodic restarts, and the named outer settings.

Why: every asynchronous push is stale, computed from parameters that other pushes (and the momentum step) have
moved since. When one round moves the model a large part of the way to where the loss wants it (early training,
short runs, large inner LR), a stale push counts again a displacement that the momentum already made, and a heavy
momentum (0.9) turns that into an oscillation that short runs never leave: the global model can end worse than
it started (issue 15; ``tests/test_momentum.py`` shows it on a quadratic). Two remedies bound how much momentum
can build up on stale pushes without giving it up where pushes agree:

* **warm-up**: ``beta_k = beta * min(1, k / warmup)`` for the k-th momentum update, so the first rounds, which
  move the model furthest, are taken with little momentum;
* **periodic restart** (arXiv 2605.28585): the momentum buffer is zeroed before every ``restart``-th momentum
  update, so an oscillation dies out within ``restart`` updates.

Pure: no Lightning, no process groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_hdet._checks import check_choice, check_int, check_number


@dataclass(frozen=True)
class MomentumSchedule:
    """``beta`` for the k-th momentum update (k = 1, 2, ...) and whether the momentum restarts before it.

    Args:
        momentum: ``beta`` after the warm-up, in [0, 1).
        warmup: momentum updates over which ``beta`` ramps up linearly (0: none).
        restart: zero the momentum buffer before every ``restart``-th momentum update (0: never).
    """

    momentum: float
    warmup: int = 0
    restart: int = 0

    def __post_init__(self) -> None:
        check_number("outer_momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_int("momentum_warmup", self.warmup, minimum=0)
        check_int("momentum_restart", self.restart, minimum=0)

    def beta(self, update: int) -> float:
        """``momentum * min(1, update / warmup)``."""
        if self.warmup and update < self.warmup:
            return self.momentum * update / self.warmup
        return self.momentum

    def restarts(self, update: int) -> bool:
        """Whether the momentum buffer is zeroed before the ``update``-th momentum update."""
        return bool(self.restart) and update % self.restart == 0


@dataclass(frozen=True)
class OuterPreset:
    """One named choice of the outer optimizer's numbers (see :data:`OUTER_PRESETS`)."""

    lr: float
    momentum: float
    warmup: int
    restart: int


#: ``"published"``: DiLoCo's and the asynchronous Local-SGD paper's outer Nesterov (lr 0.7, momentum 0.9).
#: ``"robust"``: the default of ``mode="async"``, chosen from the sweep in docs/async.md: the published lr and
#: momentum with a momentum warm-up and periodic restarts, which keep short runs from oscillating.
OUTER_PRESETS: dict[str, OuterPreset] = {
    "published": OuterPreset(lr=0.7, momentum=0.9, warmup=0, restart=0),
    "robust": OuterPreset(lr=0.7, momentum=0.9, warmup=16, restart=8),
}


def resolve_outer(
    outer: Optional[str],
    mode: str,
    lr: Optional[float] = None,
    momentum: Optional[float] = None,
    warmup: Optional[int] = None,
    restart: Optional[int] = None,
) -> OuterPreset:
    """The preset ``outer`` (default: ``"robust"`` for ``mode="async"``, ``"published"`` for DiLoCo) with every
    explicitly given number in its place."""
    if outer is None:
        outer = "robust" if mode == "async" else "published"
    check_choice("outer", outer, tuple(OUTER_PRESETS), hint="Or leave it unset and give the numbers explicitly.")
    given: dict[str, Any] = {"lr": lr, "momentum": momentum, "warmup": warmup, "restart": restart}
    settings = {**asdict(OUTER_PRESETS[outer]), **{k: v for k, v in given.items() if v is not None}}
    return OuterPreset(**settings)
