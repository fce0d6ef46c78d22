"""The collectives between HDET ranks, injected: process groups in a run, memory in a test.

Everything HDET exchanges between ranks goes through one :class:`Communicator`: the sums of merges and votes, the
guard's gradient mean and flags, the merged model of a checkpoint, the sharded strategy's start from group 0.
:class:`ProcessGroupCommunicator` runs it on ``torch.distributed`` (what every strategy uses unless given another)
and :class:`~lightning_hdet.hdet.execution.fake.InMemoryCommunicator` on the threads of an in-memory world, so the code
above it (:class:`~lightning_hdet.hdet.execution.merge.Merger`, :meth:`GroupComm.gather_group_values`, the guard, the
checkpoint reductions) is the same code in a run and in a one-process test, as torchft's ``LocalSGD`` takes its
``Manager``. Every method works in place on device tensors and returns no host value (no device-to-host sync).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet.hdet.layout import GroupLayout

#: How an all-reduce combines the ranks' tensors.
ReduceOp = Literal["sum", "max", "min"]
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class Communicator(Protocol):
    """Collectives between ranks, called on every rank of ``group`` in the same order with the same shapes.

    ``group`` is a process group of the communicator's kind; ``None`` means every rank.
    """

    def world_size(self, group: Any = None) -> int:
        """The number of ranks in ``group`` (1 when there is no process group at all)."""

    def all_reduce(self, tensor: Tensor, group: Any = None, op: ReduceOp = "sum") -> None:
        """Replace ``tensor`` by its sum (or elementwise max, min) over the ranks of ``group``, in place."""

    def all_reduce_future(self, tensor: Tensor, group: Any = None) -> torch.futures.Future[Tensor]:
        """Start summing ``tensor`` over ``group`` in place; the future gives ``tensor`` once summed (what a DDP
        communication hook returns, so the reduction overlaps the backward pass)."""

    def reduce(self, tensor: Tensor, dst: int = 0, group: Any = None) -> None:
        """Sum ``tensor`` over ``group`` onto global rank ``dst`` (in place there; other ranks' ``tensor`` is left
        undefined)."""

    def broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> None:
        """Give every rank of ``group`` the ``tensor`` of the group's rank ``src`` (its index inside ``group``)."""


class ProcessGroupCommunicator:
    """:class:`Communicator` over ``torch.distributed`` (the default of every HDET strategy). A sum, max or min over
    a single rank is skipped: it is the tensor itself."""

    def world_size(self, group: Any = None) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(group)

    def all_reduce(self, tensor: Tensor, group: Any = None, op: ReduceOp = "sum") -> None:
        if self.world_size(group) > 1:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, _OPS[op]), group=group)

    def all_reduce_future(self, tensor: Tensor, group: Any = None) -> torch.futures.Future[Tensor]:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    def reduce(self, tensor: Tensor, dst: int = 0, group: Any = None) -> None:
        dist.reduce(tensor, dst=dst, group=group)

    def broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> None:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group is not None else src, group=group)


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
