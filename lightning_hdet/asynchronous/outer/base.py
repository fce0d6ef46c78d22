"""The outer optimizer as one object (pure): a frozen dataclass whose fields are its checked options, which builds
the ``torch.optim.Optimizer`` stepping the global model's fragments and picks its step policy. Its hooks refuse a
mode, a number of workers, codecs or an elastic service it has no point with; ``forwards_rounds``: its change is
exactly the round's sparse pushes, which pulls may forward. A preset name only builds one (:mod:`.momentum`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, ClassVar

from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import KnownArguments
from lightning_hdet.asynchronous.outer.lookahead import LookaheadLR
from lightning_hdet.asynchronous.outer.state import AsyncStep, StepPolicy, SyncStep
from lightning_hdet.asynchronous.wire.codecs import Codec


class OuterOptimizer(KnownArguments):
    """Base of the outer optimizers (``DelayedNesterov``, ``Nesterov``, ``SparseLoCo``)."""

    forwards_rounds: ClassVar[bool] = False
    buffer_size: int | None = None
    lookahead: LookaheadLR | None = None  # the outer lr picked by a lookahead (DelayedNesterov's option)

    def numbers(self) -> dict[str, Any]:
        """Every option in force, by name (the run config); an option that is an object, by its own numbers."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            nested = value.numbers() if hasattr(value, "numbers") else None
            out.update({f"{f.name}/{k}": v for k, v in nested.items()} if nested else {f.name: value})
        return out

    def check(self, mode: str, stagger: int) -> None:
        """Refuse a ``mode`` (``"async"`` / ``"sync"``) or ``stagger`` this optimizer has no point with."""

    def check_workers(self, workers: int) -> None:
        """What depends on the number of workers (before any process)."""

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
        """The ``torch.optim.Optimizer`` stepping the global model's fragments ``views``."""
        raise NotImplementedError

    def step_policy(self, mode: str, stagger: int, grace_period: float | None) -> StepPolicy:
        """How pushes become outer updates: each on arrival (async) or the round's mean (DiLoCo)."""
        return AsyncStep(grace_period or 0.0) if mode == "async" else SyncStep(stagger)
