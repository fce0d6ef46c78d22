"""The named outer optimizers (``outer="stable"``, ...): one table of numbers, the objects they build, and why the
default momentum has a warm-up and restarts.

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
:func:`stable_outer_lr`, which also bounds how far one push moves the model through the momentum in all
(:func:`momentum_tail`; issue 42's elastic runs, where each worker reads the whole of its own dataset).

Pure: no Lightning, no process groups.
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
    """One named choice of the outer optimizer's numbers (see :data:`OUTER_PRESETS`); ``lr=None``: derived from
    the momentum and its restarts by :func:`stable_outer_lr`. ``sparse``: :class:`~.sparseloco.SparseLoCo` instead of
    :class:`~.delayed_nesterov.DelayedNesterov`."""

    lr: Optional[float]
    momentum: float
    warmup: int
    restart: int
    sparse: bool = False


def momentum_tail(momentum: float, restart: int) -> float:
    """How far one push moves the model in all, in units of ``outer_lr`` times the push (with Delayed Nesterov: one
    momentum update's ``N`` pushes, each ``1 / N`` of it), at the most: its own Nesterov step ``1 + beta`` and the
    momentum's echo of it until the momentum restarts, ``1 + beta + ... + beta^restart`` (a push right after a
    restart is echoed at ``restart - 1`` later momentum updates), or ``1 / (1 - beta)`` without restarts."""
    if restart == 0:
        return 1.0 / (1.0 - momentum)
    return sum(momentum**k for k in range(restart + 1))


def stable_outer_lr(momentum: float, restart: int) -> float:
    """The default outer lr for outer (Nesterov) momentum ``beta`` restarted every ``restart`` momentum updates: the
    smaller of two bounds, ``min((1 + beta) / (2 * (1 + 2 * beta)), 1 / momentum_tail(beta, restart))`` (0.163 at
    0.9 restarted every 8; 0.375 at 0.5; 0.5 without momentum).

    * **The round** (``(1 + beta) / (2 * (1 + 2 * beta))``, 0.339 at 0.9): a round of a stable inner optimizer moves
      a worker at most to the mirror image of its start (each step contracts the error, possibly flipping its
      sign), so the pseudo-gradient's Jacobian has eigenvalues in ``[0, 2]``. Nesterov's outer step on eigenvalue
      ``lam`` is stable iff ``lr * lam < 2 (1 + beta) / (1 + 2 beta)``: 0.679 at 0.9, just below the published 0.7,
      which is why two workers diverged there (issue 42). Half of it: an asynchronous push is about one momentum
      update stale, and one step of delay halves gradient descent's stable range.
    * **The push's whole echo** (``1 / momentum_tail(beta, restart)``, 0.163 at 0.9 restarted every 8): the round's
      bound holds where the next rounds revisit a push's directions and correct what the momentum carried too far.
      Where they do not for several rounds (each worker reads a dataset of many rounds, as an elastic worker reads
      the whole of its own), nothing corrects it meanwhile, and a push (or one momentum update's worth of pushes,
      which point at the same error) moves the model by ``lr * momentum_tail`` times itself in all. At most 1: the
      momentum never carries the model further along a push than the round itself went. At 0.339 (the round's
      bound alone, the default before) that was 2.1: issue 42's elastic runs stalled near 1e-2 x the start and
      rose; in the one-process simulation of ``benchmarks/outer_stability.py`` (``--data whole``) it rose for
      2, 4 and 8 workers, and 0.25 (1.5) still rose for 2 and 4.

    Neither depends on the number of workers or ``H``.
    """
    return min((1.0 + momentum) / (2.0 * (1.0 + 2.0 * momentum)), 1.0 / momentum_tail(momentum, restart))


#: ``"stable"``: the default in both modes: momentum 0.5 with the warm-up and restarts of ``"robust"`` and the
#: outer lr of :func:`stable_outer_lr` (0.375), stable for any number of workers and any data order (docs/async.md,
#: issues 42 and 60: the best worst case over ``benchmarks/outer_sweep.py``'s cells; 0.9 and 0.163 before).
#: ``"published"``: DiLoCo's and the asynchronous Local-SGD paper's outer Nesterov (lr 0.7, momentum 0.9).
#: ``"robust"``: the async default before issue 42, chosen from the sweep in docs/async.md: the published lr and
#: momentum with a momentum warm-up and periodic restarts, which keep short runs from oscillating; it diverges
#: with two workers on BoringModel + SGD.
#: ``"sparseloco"``: DiLoCo only, with a sparse codec: SparseLoCo's update (arXiv 2508.15706), ``-lr`` times the
#: mean of the round's sparse pushes with no outer momentum (the workers' decayed error feedback carries it; lr 1,
#: the paper's), so that the global model's change is exactly sparse (:mod:`.sparse_outer`).
OUTER_PRESETS: dict[str, OuterPreset] = {
    "stable": OuterPreset(lr=None, momentum=0.5, warmup=16, restart=8),
    "published": OuterPreset(lr=0.7, momentum=0.9, warmup=0, restart=0),
    "robust": OuterPreset(lr=0.7, momentum=0.9, warmup=16, restart=8),
    "sparseloco": OuterPreset(lr=1.0, momentum=0.0, warmup=0, restart=0, sparse=True),
}
#: The preset used when ``outer`` is not given, in both modes.
DEFAULT_OUTER = "stable"


def outer_from(value: OuterOptimizer | str | None) -> OuterOptimizer:
    """The outer optimizer object for what a user gave ``outer``: an object (as it is), or a preset's name
    (:data:`OUTER_PRESETS`; ``None``: :data:`DEFAULT_OUTER`), whose numbers the object's repr shows."""
    if isinstance(value, OuterOptimizer):
        return value
    name = DEFAULT_OUTER if value is None else value
    check_choice("outer", name, tuple(OUTER_PRESETS), hint="Or an object: DelayedNesterov(lr, momentum, warmup,"
                 " restarts, buffer_size), Nesterov(lr, momentum), SparseLoCo(lr, error_decay).")
    preset = OUTER_PRESETS[name]
    if preset.sparse:
        return SparseLoCo(lr=preset.lr if preset.lr is not None else 1.0)
    lr = stable_outer_lr(preset.momentum, preset.restart) if preset.lr is None else preset.lr
    return DelayedNesterov(lr=lr, momentum=preset.momentum, warmup=preset.warmup, restarts=preset.restart)


#: The strategy arguments the outer optimizer objects replaced, and what to write instead.
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
}


def refuse_moved(owner: str, given: Mapping[str, Any]) -> None:
    """Refuse an argument an object now holds (:data:`MOVED`), naming what to write instead."""
    for name, value in given.items():
        if name in MOVED:
            raise ArgumentNameError(f"{owner} no longer takes `{name}`={value!r}: the outer optimizer and the push"
                                    f" checks are objects. Write {MOVED[name]} (see docs/async.md).")
