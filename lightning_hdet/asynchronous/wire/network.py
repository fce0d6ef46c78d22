"""The transport a strategy is given (``transport=...``), where another engine's goes: a picklable factory that,
once the strategy's groups exist, builds rank 0's :class:`~.transport.ServerTransport` and each remote worker's
:class:`~.transport.WorkerTransport`, reusing :func:`~.transport.send_push` and friends for the byte order. Every
tensor an end sees is on the host, so an end never syncs a device."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from lightning_hdet.asynchronous.wire.messages import Fragments
from lightning_hdet.asynchronous.wire.transport import (
    GlooServerTransport,
    GlooWorkerTransport,
    ServerTransport,
    WorkerTransport,
)


@dataclass(frozen=True)
class Link:
    """What a :class:`Transport` builds an end from (``groups``: the strategy's two, ``()`` in one process)."""

    layout: Fragments
    n_buffers: int
    groups: tuple[Any, ...] = ()
    ranks_per_worker: int = 1


class Transport(ABC):
    """Builds rank 0's end for the remote workers and each remote worker's end (picklable; holds no connection)."""

    @abstractmethod
    def server_end(self, link: Link) -> ServerTransport:
        """Rank 0: its end for workers ``1 .. W-1`` (receives their pushes, replies to each)."""

    @abstractmethod
    def worker_end(self, link: Link, worker: int) -> WorkerTransport:
        """Worker ``worker`` (> 0), on its leader rank: its end to the server."""

    def local_end(self, end: WorkerTransport, link: Link) -> WorkerTransport:
        """Rank 0's own worker: ``end`` talks to the server in process; returned as is unless a wrapper slows it."""
        return end

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PointToPoint(Transport):
    """The default: point to point over two ``gloo`` groups (pushes, replies), whatever the backend."""

    def server_end(self, link: Link) -> ServerTransport:
        return GlooServerTransport(*link.groups, link.layout, link.n_buffers, ranks_per_worker=link.ranks_per_worker)

    def worker_end(self, link: Link, worker: int) -> WorkerTransport:
        return GlooWorkerTransport(*link.groups, link.layout, worker)


def check_transport(transport: Any) -> Transport:
    """``transport`` (``None``: :class:`PointToPoint`), refused unless a :class:`Transport`."""
    if transport is None:
        return PointToPoint()
    if not isinstance(transport, Transport):
        raise TypeError(f"`transport={transport!r}` is not a Transport. Pass PointToPoint() (the default: gloo"
                        " point-to-point), SlowLink(...) or a subclass of lightning_hdet.Transport that builds"
                        " server_end() and worker_end().")
    return transport
