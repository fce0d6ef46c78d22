"""The collectives between HDET groups, injected: process groups in a run, memory in a test.

Everything HDET exchanges between ranks is a sum: a merge sums ``coefficient * theta`` bucket by bucket, a vote
sums one row of numbers per group. :class:`Communicator` is that one operation (``all_reduce``, a sum in place over
a process group); :class:`ProcessGroupCommunicator` runs it on ``torch.distributed`` and
:class:`~lightning_hdet.hdet.fake.InMemoryCommunicator` on the threads of an in-memory world, so the merge and vote
code above it (:class:`~lightning_hdet.hdet.merge.Merger`, :meth:`GroupComm.gather_group_values`) is the same code
in a run and in a one-process test, as torchft's ``LocalSGD`` takes its ``Manager``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet.hdet.layout import GroupLayout


class Communicator(Protocol):
    """Sums between ranks (called on every rank of ``group``, in the same order)."""

    def all_reduce(self, tensor: Tensor, group: Any = None) -> None:
        """Replace ``tensor`` by its sum over the ranks of ``group`` (``None``: every rank), in place."""


class ProcessGroupCommunicator:
    """:class:`Communicator` over ``torch.distributed`` (nothing to do without a process group of several ranks)."""

    def all_reduce(self, tensor: Tensor, group: Any = None) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)


class Place(Protocol):
    """Where a rank stands: read by :class:`GroupComm` at each call (a strategy knows its rank only once launched)."""

    @property
    def layout(self) -> GroupLayout: ...

    @property
    def group_index(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...


class GroupComm:
    """One rank's view of the groups: its place (``layout``, ``group_index``, ``root_device``, read from ``place``)
    and the collectives between them (``comm``)."""

    def __init__(self, place: Place, comm: Communicator) -> None:
        self.place = place
        self.comm = comm

    @property
    def layout(self) -> GroupLayout:
        return self.place.layout

    @property
    def group_index(self) -> int:
        return self.place.group_index

    @property
    def num_groups(self) -> int:
        return self.place.layout.num_groups

    @property
    def root_device(self) -> torch.device:
        return self.place.root_device

    def all_reduce(self, tensor: Tensor, group: Any = None) -> None:
        self.comm.all_reduce(tensor, group)

    def gather_group_values(self, values: Tensor) -> Tensor:
        """Sum ``values`` (1-D, this rank's numbers) over the ranks of each group; return ``(num_groups, k)`` on the
        host. One small all-reduce over all ranks: each rank writes its row into a zero table, so every rank gets
        every group's row."""
        values = values.to(self.root_device, torch.float64).reshape(-1)
        table = torch.zeros(self.layout.num_groups, values.numel(), dtype=torch.float64, device=self.root_device)
        table[self.group_index] = values
        self.comm.all_reduce(table)
        return table.cpu()
