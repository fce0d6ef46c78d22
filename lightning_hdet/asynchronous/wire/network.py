"""The transport a strategy is given (``AsyncLocalSGDStrategy(transport=...)``): what carries the exchange's messages
between the workers and rank 0's server. This is the place another engine's transport goes.

A :class:`Transport` is a factory: it holds no connection itself (it crosses the launcher to every process with the
strategy) and, once the strategy's process groups exist, builds the two ends the exchange uses: rank 0's
:class:`~.transport.ServerTransport` for the remote workers and each remote worker's
:class:`~.transport.WorkerTransport`. Rank 0's own worker talks to its server in process
(:class:`~.transport.InProcessTransport`); :meth:`Transport.local_end` may wrap that end (a slow link does).

* :class:`PointToPoint` (the default): point-to-point ``send`` / ``recv`` over the strategy's two ``gloo`` groups.
* :class:`~.memory.MemoryTransport`: every worker and the server in one process, through queues (tests).
* :class:`~lightning_hdet.testing.SlowLink`: any transport, as slow as a link of a given bandwidth and latency.

What an end carries is fixed by :mod:`.messages` (headers, fragments in their codecs, buffers, inner state) and the
order by :func:`~.transport.send_push` / :func:`~.transport.send_reply`: an end over another engine (e.g. a
fault-tolerant collective library) implements ``push`` / ``pull`` (worker) and ``receive`` / ``reply`` (server) on
its own point-to-point calls, reusing those functions for the byte order. Every tensor an end sees is on the host
(pinned on CUDA): the worker reads the model into host buffers before it pushes, so an end never syncs a device.
"""

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
    """What a :class:`Transport` builds an end from, once the strategy's groups exist.

    Args:
        layout: the model's fragments and their codecs (the same on every worker and at the server).
        n_buffers: float32 buffer values that follow the parameters in a push and a reply.
        groups: the strategy's two ``gloo`` groups over every rank (pushes, replies); a transport that does not
            run on process groups ignores them (``()`` in one process).
        ranks_per_worker: ranks in a worker; worker ``w``'s leader, the rank that pushes and pulls, is
            ``w * ranks_per_worker``.
    """

    layout: Fragments
    n_buffers: int
    groups: tuple[Any, ...] = ()
    ranks_per_worker: int = 1

    def leader(self, worker: int) -> int:
        """The global rank that exchanges for ``worker``."""
        return worker * self.ranks_per_worker


class Transport(ABC):
    """How the exchange's messages travel: builds rank 0's end for the remote workers and each remote worker's end.

    Built ends are closed by the exchange when it ends (:meth:`~.transport.WorkerTransport.close`); a transport
    itself must stay picklable (it crosses spawn with the strategy) and holds no connection.
    """

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
    """The default transport: point-to-point messages to and from rank 0 over the strategy's two ``gloo`` groups
    (one for pushes, one for replies, so that rank 0's receiving and replying threads never share a group). The
    tensors are host copies (pinned on CUDA): the groups are ``gloo`` whatever the training backend is."""

    def server_end(self, link: Link) -> ServerTransport:
        return GlooServerTransport(*link.groups, link.layout, link.n_buffers, ranks_per_worker=link.ranks_per_worker)

    def worker_end(self, link: Link, worker: int) -> WorkerTransport:
        return GlooWorkerTransport(*link.groups, link.layout, worker)


def check_transport(transport: Any) -> Transport:
    """``transport`` (``None``: :class:`PointToPoint`), refused unless it is a :class:`Transport`."""
    if transport is None:
        return PointToPoint()
    if not isinstance(transport, Transport):
        raise TypeError(f"`transport={transport!r}` is not a Transport. Pass PointToPoint() (the default: gloo"
                        " point-to-point), SlowLink(...) or a subclass of lightning_hdet.Transport that builds"
                        " server_end() and worker_end().")
    return transport
