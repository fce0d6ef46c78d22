"""Workers of several ranks (the collectives over a worker's group are injected): a worker of ``k`` ranks trains
as DDP inside and exchanges as one: its *leader* (lowest rank) pushes and pulls, :class:`LeaderTransport` broadcasts
each reply to the others' :class:`FollowerTransport`, so every rank keeps the same bookkeeping. The compute time
pushed is the slowest rank's, so dynamic local steps follow it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_hdet._checks import check_int
from lightning_hdet.asynchronous.wire.messages import ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport

#: An in-place collective over one worker's ranks: a broadcast from its leader, or an all-reduce (maximum).
Collective = Callable[[Tensor], None]


def check_ranks_per_worker(ranks_per_worker: int, world_size: int | None = None) -> None:
    """Refuse a ``ranks_per_worker`` that cannot split ``world_size`` ranks into two workers or more."""
    check_int("ranks_per_worker", ranks_per_worker, minimum=1,
              hint="It is the ranks that train one worker together, DDP inside; 1: every rank is a worker.")
    if world_size is None:
        return
    if world_size % ranks_per_worker:
        raise ValueError(
            f"`ranks_per_worker={ranks_per_worker}` does not divide the world size {world_size} (devices x"
            f" num_nodes): every worker needs the same number of ranks. Use a divisor of {world_size}, e.g. the"
            " devices per node for one worker per node.")
    if world_size // ranks_per_worker < 2:
        raise ValueError(
            f"`ranks_per_worker={ranks_per_worker}` makes {world_size // ranks_per_worker} worker of"
            f" {world_size} ranks; Local-SGD needs at least 2 workers. Use ranks_per_worker <= {world_size // 2},"
            " or DDPStrategy for one group of ranks.")


@dataclass(frozen=True)
class WorkerRanks:
    """``world_size`` ranks in workers of ``ranks_per_worker`` consecutive ranks, seen from ``rank``."""

    world_size: int
    ranks_per_worker: int
    rank: int

    def __post_init__(self) -> None:
        check_ranks_per_worker(self.ranks_per_worker)
        if self.world_size % self.ranks_per_worker:  # the strategy refused it before any process group
            raise ValueError(f"{self.ranks_per_worker} ranks per worker do not divide {self.world_size} ranks")

    @property
    def workers(self) -> int:
        return self.world_size // self.ranks_per_worker

    @property
    def worker(self) -> int:
        return self.rank // self.ranks_per_worker

    @property
    def leader(self) -> int:
        """The rank that pushes and pulls for this rank's worker."""
        return self.worker * self.ranks_per_worker

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def ranks_of(self, worker: int) -> list[int]:
        """The global ranks of ``worker``, its leader first."""
        start = worker * self.ranks_per_worker
        return list(range(start, start + self.ranks_per_worker))

    def describe(self) -> str:
        """This rank's worker, as warnings name it."""
        if self.ranks_per_worker == 1:
            return f"rank {self.rank}"
        ranks = self.ranks_of(self.worker)
        return f"worker {self.worker} (ranks {ranks[0]}-{ranks[-1]}, on rank {self.rank})"


def _closed(tensor: Tensor) -> None:
    raise RuntimeError("this worker's exchange has ended")


def slowest(header: WorkerHeader, max_reduce: Collective) -> WorkerHeader:
    """``header`` with the longest compute time among the worker's ranks (each calls this with its own)."""
    seconds = torch.tensor([header.compute_s], dtype=torch.float64)
    max_reduce(seconds)
    return replace(header, compute_s=float(seconds[0]))


class LeaderTransport(WorkerTransport):
    """The leader's end: pushes through ``inner`` and hands every reply on to its worker's ranks."""

    def __init__(self, inner: WorkerTransport, broadcast: Collective, max_reduce: Collective) -> None:
        self.inner, self.broadcast, self.max_reduce = inner, broadcast, max_reduce

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        self.inner.push(slowest(header, self.max_reduce), messages, buffers, inner_state)

    def pull(self, into: Tensor) -> ServerHeader:
        header = self.inner.pull(into)
        self.broadcast(header.encode())
        if header.next_local_steps > 0:
            self.broadcast(into)
        return header

    def close(self) -> None:
        self.inner.close()
        self.broadcast = self.max_reduce = _closed  # they hold the worker's group (see Exchange.close)


class FollowerTransport(WorkerTransport):
    """A non-leader rank's end: it reports its compute time and receives the leader's broadcast."""

    def __init__(self, broadcast: Collective, max_reduce: Collective, gathers: bool = False) -> None:
        self.broadcast, self.max_reduce, self.gathers = broadcast, max_reduce, gathers

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        slowest(header, self.max_reduce)
        if self.gathers:  # FSDP2: producing the messages is this rank's part in the leader's gathers
            for _ in messages:
                pass

    def pull(self, into: Tensor) -> ServerHeader:
        header = ServerHeader.receive(self.broadcast)
        if header.next_local_steps > 0:
            self.broadcast(into)
        return header

    def close(self) -> None:
        self.broadcast = self.max_reduce = _closed  # they hold the worker's group (see Exchange.close)
