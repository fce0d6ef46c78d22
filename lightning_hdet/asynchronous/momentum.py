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

Neither bounds the outer lr, which alone decides whether one round can be amplified (issue 42: at the published 0.7
two workers diverged, async and DiLoCo alike): the default preset, ``"stable"``, takes the lr of
:func:`stable_outer_lr`.

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
    """One named choice of the outer optimizer's numbers (see :data:`OUTER_PRESETS`); ``lr=None``: derived from
    the momentum by :func:`stable_outer_lr`."""

    lr: Optional[float]
    momentum: float
    warmup: int
    restart: int


def stable_outer_lr(momentum: float) -> float:
    """The default outer lr for outer (Nesterov) momentum ``beta``: half the largest stable one,
    ``(1 + beta) / (2 * (1 + 2 * beta))`` (0.339 at 0.9, 0.5 without momentum).

    Why: a round of a stable inner optimizer moves a worker at most to the mirror image of its start (each step
    contracts the error, possibly flipping its sign), so the pseudo-gradient's Jacobian has eigenvalues in
    ``[0, 2]``. Nesterov's outer step on eigenvalue ``lam`` is stable iff ``lr * lam < 2 (1 + beta) / (1 + 2 beta)``,
    i.e. for every round iff ``lr < (1 + beta) / (1 + 2 beta)``: 0.679 at 0.9, just below the published 0.7, which
    is why two workers (the least averaging) diverged there (issue 42: BoringModel + SGD, async and DiLoCo). Half
    of it: an asynchronous push is about one momentum update stale (Delayed Nesterov with ``N`` = workers), and
    one step of delay halves gradient descent's stable range (``lr * lam < 1`` instead of 2); in DiLoCo the margin
    covers rounds that overshoot further (batch-1 SGD steps with ``lr * |x|^2`` up to 3 on BoringModel). It does
    not depend on the number of workers or ``H``: the worst round is that of one worker, at any ``H``.
    """
    return (1.0 + momentum) / (2.0 * (1.0 + 2.0 * momentum))


#: ``"stable"``: the default in both modes: momentum 0.9 with the warm-up and restarts of ``"robust"`` and the
#: outer lr of :func:`stable_outer_lr` (0.339), stable for any number of workers (docs/async.md, issue 42).
#: ``"published"``: DiLoCo's and the asynchronous Local-SGD paper's outer Nesterov (lr 0.7, momentum 0.9).
#: ``"robust"``: the async default before issue 42, chosen from the sweep in docs/async.md: the published lr and
#: momentum with a momentum warm-up and periodic restarts, which keep short runs from oscillating; it diverges
#: with two workers on BoringModel + SGD.
OUTER_PRESETS: dict[str, OuterPreset] = {
    "stable": OuterPreset(lr=None, momentum=0.9, warmup=16, restart=8),
    "published": OuterPreset(lr=0.7, momentum=0.9, warmup=0, restart=0),
    "robust": OuterPreset(lr=0.7, momentum=0.9, warmup=16, restart=8),
}
#: The preset used when ``outer`` is not given, in both modes.
DEFAULT_OUTER = "stable"


def resolve_outer(
    outer: Optional[str],
    lr: Optional[float] = None,
    momentum: Optional[float] = None,
    warmup: Optional[int] = None,
    restart: Optional[int] = None,
) -> OuterPreset:
    """The preset ``outer`` (default :data:`DEFAULT_OUTER`, async and DiLoCo alike) with every explicitly given
    number in its place; a preset without an lr (``"stable"``) derives it from the momentum in effect, so that an
    explicit ``outer_momentum`` gets the lr that keeps it stable."""
    outer = DEFAULT_OUTER if outer is None else outer
    check_choice("outer", outer, tuple(OUTER_PRESETS), hint="Or leave it unset and give the numbers explicitly.")
    given: dict[str, Any] = {"lr": lr, "momentum": momentum, "warmup": warmup, "restart": restart}
    settings = {**asdict(OUTER_PRESETS[outer]), **{k: v for k, v in given.items() if v is not None}}
    if settings["lr"] is None:  # checked as validate_outer_hyperparameters does: first finite, then in range
        check_number("outer_momentum", settings["momentum"])
        check_number("outer_momentum", settings["momentum"], 0.0, 1.0, high_open=True)
        settings["lr"] = stable_outer_lr(settings["momentum"])
    return OuterPreset(**settings)
