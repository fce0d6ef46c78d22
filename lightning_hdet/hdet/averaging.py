"""A device-side running average of a model's parameters, for ``signal="heldout"`` (torch only: no Lightning).

A high learning rate's iterate carries more noise than a low one's, so its loss is inflated until the LR decays
(constant LR + cool-down, arXiv 2405.18392); the averaged iterate of schedule-free methods (arXiv 2405.15682)
approximates the annealed one. Scoring each group's *averaged* parameters on the same held-out batches compares
the groups with that noise taken out.

The average restarts from the current parameters at every vote (after the merge: the groups' parameters jump
there), so it is the average over one interval. Step ``k`` after a restart (``k = 1, 2, ...``) moves it by
:func:`average_weight` ``(k, decay)``:

* ``decay=None``: ``1 / (k + 1)``, the uniform average of the restart point and the ``k`` iterates since;
* ``decay=beta``: ``max(1 - beta, 1 / (k + 1))``, an exponential moving average that starts uniform (so early
  steps are not dominated by the restart point; the warm-up of ``torch.optim.swa_utils`` EMAs does the same).

Per step: one ``torch._foreach_lerp_`` over the parameter list with a host-side weight, no device->host sync.
Memory: one extra copy of the averaged parameters, in their own dtype, on their own device.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor

from lightning_hdet._checks import check_int, check_number


def average_weight(k: int, decay: Optional[float] = None) -> float:
    """The weight of the ``k``-th iterate after a restart: ``avg <- avg + w (theta - avg)``."""
    check_int("k", k, minimum=1)
    check_number("heldout_decay", decay, 0.0, 1.0, high_open=True, optional=True)
    uniform = 1.0 / (k + 1)
    return uniform if decay is None else max(1.0 - decay, uniform)


class ParameterAverage:
    """The running average of ``params`` (a fixed list of tensors), restarted by :meth:`restart`."""

    def __init__(self, params: Sequence[Tensor], decay: Optional[float] = None) -> None:
        check_number("heldout_decay", decay, 0.0, 1.0, high_open=True, optional=True)
        self.params = [p for p in params]
        self.decay = decay
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]
        self.count = 0  # iterates averaged since the restart (the restart point itself not counted)

    def restart(self) -> None:
        """The average becomes the current parameters (after a merge or a roll-back)."""
        with torch.no_grad():
            torch._foreach_copy_(self.average, [p.detach() for p in self.params])
        self.count = 0

    def update(self) -> None:
        """Fold the current parameters in (call once per optimizer step)."""
        self.count += 1
        weight = average_weight(self.count, self.decay)  # a host float: no device->host sync
        with torch.no_grad():
            torch._foreach_lerp_(self.average, [p.detach() for p in self.params], weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the parameters hold the average (and the average the parameters): a swap of the
        tensors' ``.data``, so no copy and no extra memory; swapped back on exit, also on an error."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for i, p in enumerate(self.params):
            p.data, self.average[i] = self.average[i], p.data
