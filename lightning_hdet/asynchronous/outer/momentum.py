"""The named outer optimizers (``outer="stable"``, ...): one table of numbers, the objects they build, and why the
default momentum has a warm-up and restarts (pure).

Every async push is stale. When one round moves the model far (early training, large inner lr), a stale push counts
again a displacement the momentum already made, and a heavy momentum (0.9) turns that into an oscillation short runs
never leave (issue 15; ``tests/test_momentum.py``). A **warm-up** (``beta_k = beta * min(1, k / warmup)``) takes
the first, largest rounds with little momentum; a **periodic restart** (arXiv 2605.28585) zeroes the momentum every
``restart`` updates, so an oscillation dies out. Neither bounds the outer lr, which alone decides whether one round
can be amplified (issue 42): ``"stable"`` takes :func:`stable_outer_lr`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hdet._checks import ArgumentNameError, check_choice
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.sparseloco import SparseLoCo


@dataclass(frozen=True)
class OuterPreset:
    """One preset's numbers (``lr=None``: :func:`stable_outer_lr`; ``sparse``: SparseLoCo, not DelayedNesterov)."""

    lr: Optional[float]
    momentum: float
    warmup: int
    restart: int
    sparse: bool = False


def momentum_tail(momentum: float, restarts: int) -> float:
    """At most how far one push moves the model, in ``lr`` times the push: ``sum(beta**k, k <= restarts)``."""
    return 1.0 / (1.0 - momentum) if restarts == 0 else sum(momentum**k for k in range(restarts + 1))


def stable_outer_lr(momentum: float, restarts: int) -> float:
    """The default outer lr for Nesterov momentum ``beta`` restarted every ``restarts`` updates (as
    :class:`DelayedNesterov` names them), the smaller of two bounds (0.375 at 0.5 restarted every 8; 0.163 at 0.9;
    0.5 without momentum); neither depends on W or ``H``.

    * **The round**, ``(1 + beta) / (2 * (1 + 2 * beta))``: a stable inner round gives the pseudo-gradient's Jacobian
      eigenvalues in ``[0, 2]``; Nesterov's outer step is stable iff ``lr * lam < 2 (1 + beta) / (1 + 2 beta)``
      (0.679 at 0.9, just below the published 0.7: issue 42's divergence); halved, as one step of delay halves the
      stable range.
    * **The push's whole echo**, ``1 / momentum_tail(beta, restarts)``: where later rounds do not revisit a push's
      directions (each worker reads a dataset of many rounds), nothing corrects what the momentum carried on, so the
      momentum must never move the model further along a push than the round went (at the round's bound alone,
      0.339 at 0.9, issue 42's elastic runs and ``benchmarks/outer_stability.py --data whole`` rose).
    """
    return min((1.0 + momentum) / (2.0 * (1.0 + 2.0 * momentum)), 1.0 / momentum_tail(momentum, restarts))


#: ``"stable"``, the default: momentum 0.5 with warm-up and restarts and :func:`stable_outer_lr` (0.375), the best
#: worst case over ``benchmarks/outer_sweep.py``'s cells (issue 60). ``"published"``: DiLoCo's outer Nesterov.
#: ``"robust"``: the published numbers with warm-up and restarts (the async default before issue 42; diverges with
#: two workers on BoringModel + SGD). ``"sparseloco"``: DiLoCo only, SparseLoCo's update (:mod:`.sparseloco`).
OUTER_PRESETS: dict[str, OuterPreset] = {
    "stable": OuterPreset(lr=None, momentum=0.5, warmup=16, restart=8),
    "published": OuterPreset(lr=0.7, momentum=0.9, warmup=0, restart=0),
    "robust": OuterPreset(lr=0.7, momentum=0.9, warmup=16, restart=8),
    "sparseloco": OuterPreset(lr=1.0, momentum=0.0, warmup=0, restart=0, sparse=True),
}
#: The preset used when ``outer`` is not given, in both modes.
DEFAULT_OUTER = "stable"


def outer_from(value: OuterOptimizer | str | None) -> OuterOptimizer:
    """The outer optimizer object for ``outer``: an object as it is, or a preset's name (``None``: the default)."""
    if isinstance(value, OuterOptimizer):
        return value
    name = DEFAULT_OUTER if value is None else value
    check_choice("outer", name, tuple(OUTER_PRESETS), hint="Or an object: DelayedNesterov(lr, momentum, warmup,"
                 " restarts, buffer_size, lookahead), Nesterov(lr, momentum), SparseLoCo(lr, error_decay).")
    preset = OUTER_PRESETS[name]
    if preset.sparse:
        return SparseLoCo(lr=preset.lr if preset.lr is not None else 1.0)
    lr = stable_outer_lr(preset.momentum, preset.restart) if preset.lr is None else preset.lr
    return DelayedNesterov(lr=lr, momentum=preset.momentum, warmup=preset.warmup, restarts=preset.restart)


#: The strategy arguments objects replaced, and what to write instead.
MOVED: dict[str, str] = {
    "outer_lr": "outer=DelayedNesterov(lr=...)", "outer_momentum": "outer=DelayedNesterov(lr=..., momentum=...)",
    "delayed_nesterov": "outer=Nesterov(lr=..., momentum=...) (False) or outer=DelayedNesterov(...) (True)",
    "buffer_size": "outer=DelayedNesterov(lr=..., buffer_size=...)",
    "momentum_activation": "outer=DelayedNesterov(lr=..., momentum_activation=...)",
    "momentum_warmup": "outer=DelayedNesterov(lr=..., warmup=...)",
    "momentum_restart": "outer=DelayedNesterov(lr=..., restarts=...)",
    "error_decay": "outer=SparseLoCo(error_decay=...)",
    "max_norm_ratio": "check_pushes=PushCheck(max_norm_ratio=...)",
    "max_rejections": "check_pushes=PushCheck(max_rejections=...)",
    "dynamic_local_steps": "local_steps=AdaptiveSteps(start=H) (True, the async default) or local_steps=H (False)",
    "min_local_steps": "local_steps=AdaptiveSteps(start=H, min=...)",
    "grace_period": "local_steps=AdaptiveSteps(start=H, grace_period=...)",
    "speed_smoothing": "local_steps=AdaptiveSteps(start=H, smoothing=...)",
}


def refuse_moved(owner: str, given: Mapping[str, Any]) -> None:
    """Refuse an argument an object now holds (:data:`MOVED`), naming what to write instead."""
    for name, value in given.items():
        if name in MOVED:
            raise ArgumentNameError(f"{owner} no longer takes `{name}`={value!r}: it is an option of an object now."
                                    f" Write {MOVED[name]} (see docs/async.md).")
