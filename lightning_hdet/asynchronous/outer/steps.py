"""How a batch of pushes becomes outer updates, and how long a worker's next round is: the step policies of the two
modes, :class:`AsyncStep` and :class:`SyncStep` (DiLoCo). An outer optimizer object picks its policy
(:meth:`~.base.OuterOptimizer.step_policy`; SparseLoCo has its own). Pure: no process groups, no Lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from lightning_hdet._checks import check_int

if TYPE_CHECKING:
    from lightning_hdet.asynchronous.outer.state import OuterState


class StepPolicy(Protocol):
    """How a batch of pushes becomes outer updates, and how long a worker's next round is."""

    #: ``"async"`` or ``"sync"`` (recorded in checkpoints).
    mode: str
    #: Seconds after a batch's first push during which later pushes join it; ``None``: until every worker
    #: still training has pushed.
    batch_window: float | None

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        """One arriving fragment of a push's pseudo-gradient (``index``: which fragment)."""

    def pushed(self, outer: OuterState) -> None:
        """A push's last fragment has arrived."""

    def close(self, outer: OuterState, pushes: int) -> None:
        """The batch closed; ``pushes`` of its pushes carried a pseudo-gradient."""

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        """``worker``'s next round length within the budget left (``n_waiting`` workers wait for a reply)."""

    def keeps_messages(self, codecs: list, workers: int) -> object | None:
        """Where the server keeps each applied push's messages for this policy (``None``: it keeps none)."""


class AsyncStep:
    """Asynchronous Local-SGD: every push is its own outer update, in arrival order; each worker's next round
    length follows its speed; the budget left is shared without waiting for anyone.

    Args:
        grace_period: pushes arriving within this many seconds of a batch's first one join that batch.
    """

    mode = "async"

    def __init__(self, grace_period: float = 0.0) -> None:
        self.batch_window: float | None = grace_period

    def keeps_messages(self, codecs: list, workers: int) -> object | None:
        return None

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        outer.step_fragment(index, gradient)

    def pushed(self, outer: OuterState) -> None:
        outer.outer_updates += 1

    def close(self, outer: OuterState, pushes: int) -> None:
        pass

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        steps = outer.local_steps.next_local_steps(worker)
        if outer.budget is None:
            return steps
        in_flight = sum(s.in_flight for w, s in outer.workers.items() if w != worker)
        return min(steps, outer.budget - outer.steps_done - in_flight - outer.pending_steps)


class SyncStep:
    """DiLoCo: one outer update with the mean of every worker's push; every worker runs ``H`` steps, the last
    round shortened so that the budget is met exactly.

    Args:
        stagger: ``F``: rounds are ``H / F`` steps long and each push carries one of ``F`` parts of the model
            (Streaming DiLoCo; :mod:`.overlap`), so each fragment's outer step takes the mean of the pushes that
            carried it.
    """

    mode = "sync"
    #: ``None``: a batch waits for every worker still training.
    batch_window: float | None = None

    def __init__(self, stagger: int = 1) -> None:
        self.stagger = stagger
        self._sum: Tensor | None = None  # the round's summed pseudo-gradient: one model, not one per worker
        self._counts: list[int] = []  # per fragment, how many pushes are in the sum

    def keeps_messages(self, codecs: list, workers: int) -> object | None:
        return None

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        if self._sum is None:
            self._sum, self._counts = torch.zeros_like(outer.params), [0] * len(outer.ranges)
        start, end = outer.ranges[index]
        self._sum[start:end].add_(gradient)
        self._counts[index] += 1

    def pushed(self, outer: OuterState) -> None:
        pass

    def close(self, outer: OuterState, pushes: int) -> None:
        """One outer update: each fragment that pushes carried steps with their mean."""
        if not pushes:
            return
        if self._sum is not None:
            for index, (start, end) in enumerate(outer.ranges):
                if self._counts[index]:
                    outer.step_fragment(index, self._sum[start:end].div_(self._counts[index]))
                    self._counts[index] = 0
            self._sum.zero_()
        outer.outer_updates += 1

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        steps = outer.local_steps.local_steps // self.stagger
        if outer.budget is None:
            return steps
        return min(steps, (outer.budget - outer.steps_done - outer.pending_steps) // n_waiting)




def check_stagger(stagger: int, mode: str, local_steps: int) -> None:
    """``stagger``: 1, or with DiLoCo a divisor ``F`` of ``local_steps`` (rounds of ``local_steps / F`` steps)."""
    check_int("stagger", stagger, minimum=1, hint="1 synchronises the whole model at once; F >= 2 (DiLoCo) in F"
              " parts, one every local_steps / F steps.")
    if stagger > 1 and mode != "sync":
        raise ValueError(f"`stagger={stagger}` applies to DiLoCo only (mode='sync'), got mode={mode!r}: an async"
                         " push is applied on arrival, with no common round to stagger. Use stagger=1, or"
                         " mode='sync'.")
    if local_steps % stagger:
        divisors = [d for d in range(1, local_steps + 1) if local_steps % d == 0]
        raise ValueError(f"`stagger={stagger}` does not divide local_steps={local_steps}: each part is synchronised"
                         f" every local_steps steps, one part every local_steps / stagger. Allowed: {divisors}.")
