"""The outer optimizer as one object: its options, checks and step (pure: no Lightning, no process groups).

An outer optimizer (:class:`OuterOptimizer`) is a frozen dataclass: its options are fields checked in
``__post_init__`` (errors name the argument, the value, what is allowed), its step is the ``torch.optim.Optimizer``
it builds over the global model's fragments (:meth:`~OuterOptimizer.optimizer`) and the step policy it runs in
(:meth:`~OuterOptimizer.step_policy`). What the strategy, the server and the workers ask of it besides those:

* :meth:`~OuterOptimizer.check` / :meth:`~OuterOptimizer.check_workers` / :meth:`~OuterOptimizer.check_codecs` /
  :meth:`~OuterOptimizer.check_elastic`: refuse a mode, a number of workers, codecs or an elastic service it has
  no point with (each before any process exists);
* ``forwards_rounds``: the global model's change is exactly the round's sparse pushes, so sparse pulls may forward
  them (:meth:`~OuterOptimizer.forward`);
* :meth:`~OuterOptimizer.feedback_decay`: the decay of the workers' error feedback (``None``: plain);
* :meth:`~OuterOptimizer.numbers`: every number in force (the run config; the repr shows them too).

The object the user passes is the one that runs: a preset name (``outer="stable"``) only builds one
(:mod:`.momentum`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, ClassVar

from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import KnownArguments
from lightning_hdet.asynchronous.outer.state import AsyncStep, StepPolicy, SyncStep
from lightning_hdet.asynchronous.wire.codecs import Codec


class OuterOptimizer(KnownArguments):
    """Base of the outer optimizers (:class:`~.delayed_nesterov.DelayedNesterov`,
    :class:`~.delayed_nesterov.Nesterov`, :class:`~.sparseloco.SparseLoCo`)."""

    forwards_rounds: ClassVar[bool] = False
    #: The most pushes one momentum update may average (Delayed Nesterov's ``N``; ``None``: as many as are live).
    buffer_size: int | None = None

    def numbers(self) -> dict[str, Any]:
        """Every option in force, by name (recorded in the run config beside the class's name)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def check(self, mode: str, stagger: int) -> None:
        """Refuse a ``mode`` (``"async"`` / ``"sync"``) or ``stagger`` this optimizer has no point with."""

    def check_workers(self, workers: int) -> None:
        """What depends on the number of workers (checked when the Trainer is built, before any process)."""

    def check_codecs(self, push: Codec, pull: Codec) -> None:
        """Refuse codecs this optimizer cannot step from."""

    def check_elastic(self) -> None:
        """Refuse what an elastic :class:`~..elastic.service.OuterService` cannot run."""

    def feedback_decay(self) -> float | None:
        """The workers' error feedback decay (``None``: plain error feedback)."""
        return None

    def forward(self, workers: int) -> Callable[[Codec], Any] | None:
        """The codec of a round change forwarding one fragment's pushes (``forwards_rounds`` only)."""
        return None

    def follows_live(self, mode: str) -> bool:
        """Whether the optimizer's ``N`` follows the workers still training (:meth:`~.state.OuterState.follow_live`)."""
        return False

    def optimizer(self, views: Sequence[Tensor], mode: str, workers: int) -> Optimizer:
        """The ``torch.optim.Optimizer`` stepping the global model's fragments (``views``, one per fragment)."""
        raise NotImplementedError

    def step_policy(self, mode: str, stagger: int, grace_period: float | None) -> StepPolicy:
        """How pushes become outer updates: each on arrival (async) or the round's mean (DiLoCo)."""
        return AsyncStep(grace_period or 0.0) if mode == "async" else SyncStep(stagger)
