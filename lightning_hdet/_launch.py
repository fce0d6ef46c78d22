"""Lightning's fork/spawn launcher, also handing the launching process what a run found.

With ``strategy="hdet_spawn"``, ``"async_local_sgd_spawn"``, ``"diloco_spawn"``, a ``start_method="fork"`` strategy or
a notebook's fork, the fit runs in child processes; the objects the user holds (``HDETCallback()``, the strategy) are
the launching process's copies, whose ``result`` the fit never set. Lightning's launcher already carries rank 0's
``callback_metrics`` back (``get_extra_results`` / ``update_main_process_results``); this one carries, beside them,
every :class:`HandsBack` object's value, so ``hdet.result`` and ``strategy.result`` read there as on rank 0.
"""

from __future__ import annotations

import pickle
from collections import Counter
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
from typing_extensions import override

from lightning_hdet._compat import MultiProcessingLauncher

_KEY = "lightning_hdet_handed_back"


@runtime_checkable
class HandsBack(Protocol):
    """A strategy or callback whose end-of-fit value rank 0 hands to the launching process's copy of it."""

    def hand_back(self) -> Any:
        """Rank 0, after the fit: the value (``None``: nothing to hand back)."""

    def take_back(self, value: Any) -> None:
        """The launching process: keep ``value`` (what :meth:`hand_back` returned on rank 0)."""


def _holders(trainer: pl.Trainer) -> dict[str, HandsBack]:
    """The trainer's :class:`HandsBack` objects, keyed by class and rank among those of that class: the child's
    callback list can differ from the launching process's by others (a model's ``configure_callbacks``, a callback
    a strategy adds in ``connect``), and Lightning reorders it, so a position in it would not match."""
    found: dict[str, HandsBack] = {}
    seen: Counter[str] = Counter()
    for obj in (trainer.strategy, *trainer.callbacks):
        if isinstance(obj, HandsBack):
            name = type(obj).__qualname__
            found[f"{name}/{seen[name]}"] = obj
            seen[name] += 1
    return found


class HandingBackLauncher(MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, also carrying every :class:`HandsBack` object's value from rank 0."""

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        values = {key: obj.hand_back() for key, obj in _holders(trainer).items()}
        # pickled to bytes, as Lightning sends its metrics: no tensor crosses the queue by shared memory
        extra[_KEY] = pickle.dumps({key: value for key, value in values.items() if value is not None})
        return extra

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        raw = extra.get(_KEY)
        holders = _holders(trainer)
        for key, value in (pickle.loads(raw) if raw is not None else {}).items():
            if key in holders:  # a callback created in the child (no copy here) has no one to hand it to
                holders[key].take_back(value)


def handing_back(strategy: Any, launcher: Any, kind: type[HandingBackLauncher] = HandingBackLauncher) -> Any:
    """``launcher``, or a ``kind`` (a :class:`HandingBackLauncher`) in its place where it is Lightning's own
    fork/spawn one (a script launcher runs the fit in the user's process: rank 0's objects are the user's)."""
    if type(launcher) is MultiProcessingLauncher:  # built by DDPStrategy, which then holds its start method
        return kind(strategy, start_method=strategy._start_method)
    return launcher
