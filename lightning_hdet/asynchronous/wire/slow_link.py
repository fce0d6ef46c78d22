"""An emulated slow link (the base of :class:`~lightning_hdet.testing.SlowLink`): after the real transport
returns, the worker waits ``latency + bytes * 8 / bits_per_s`` each way for every byte a push and a reply carry, so
wall-clock on one machine reads as it would between sites."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from torch import Tensor

from lightning_hdet._checks import check_number
from lightning_hdet.asynchronous.wire.messages import ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.network import Link, PointToPoint, Transport, check_transport
from lightning_hdet.asynchronous.wire.transport import ServerTransport, WorkerTransport

_FLOAT64, _FLOAT32 = 8, 4


def check_link(bits_per_s: float, latency_s: float) -> None:
    """A link's ``bits_per_s`` (> 0) and ``latency_s`` (>= 0)."""
    check_number("bits_per_s", bits_per_s, low=0, low_open=True, hint="It is the link's bandwidth in bits per second.")
    check_number("latency_s", latency_s, low=0, hint="It is in seconds, one way.")


class LimitedTransport(WorkerTransport):
    """``inner``, as slow as a link of ``bits_per_s`` and ``latency_s`` (one way); ``reply_bytes``: what a reply
    carries after its header; ``sleep`` is injected so tests need no clock. :attr:`delay_s`: seconds added."""

    def __init__(self, inner: WorkerTransport, bits_per_s: float, latency_s: float,
                 reply_bytes: Callable[[ServerHeader], int], sleep: Callable[[float], None] = time.sleep) -> None:
        check_link(bits_per_s, latency_s)
        self.inner, self.bits_per_s, self.latency_s, self.reply_bytes = inner, bits_per_s, latency_s, reply_bytes
        self.sleep = sleep
        self.delay_s = 0.0

    def _travel(self, nbytes: int) -> None:
        seconds = self.latency_s + 8 * nbytes / self.bits_per_s
        self.delay_s += seconds
        self.sleep(seconds)

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        sent = [_FLOAT64 * WorkerHeader.SIZE]

        def counted() -> Iterator[Tensor]:
            for message in messages:
                sent.append(message.numel() * message.element_size())
                yield message
        self.inner.push(header, counted(), buffers, inner_state)
        sent += [part.numel() * part.element_size() for part in (buffers, inner_state) if part is not None]
        self._travel(sum(sent))

    def pull(self, into: Tensor) -> ServerHeader:
        reply = self.inner.pull(into)
        self._travel(_FLOAT64 * ServerHeader.SIZE + (self.reply_bytes(reply) if reply.next_local_steps > 0 else 0))
        return reply

    def close(self) -> None:
        self.inner.close()


class LimitedLink(Transport):
    """``inner``'s ends, each worker's whose leader is in ``ranks`` (default: not rank 0's) slowed."""

    def __init__(self, bits_per_s: float, latency_s: float = 0.0, ranks: Sequence[int] | None = None,
                 inner: Transport | None = None) -> None:
        check_link(bits_per_s, latency_s)
        self.bits_per_s, self.latency_s = bits_per_s, latency_s
        self.ranks = None if ranks is None else tuple(ranks)
        self.inner = check_transport(inner)

    def server_end(self, link: Link) -> ServerTransport:
        return self.inner.server_end(link)

    def worker_end(self, link: Link, worker: int) -> WorkerTransport:
        return self._slowed(self.inner.worker_end(link, worker), link, worker * link.ranks_per_worker)

    def local_end(self, end: WorkerTransport, link: Link) -> WorkerTransport:
        return self._slowed(self.inner.local_end(end, link), link, 0)

    def _slowed(self, end: WorkerTransport, link: Link, rank: int) -> WorkerTransport:
        if (rank == 0) if self.ranks is None else (rank not in self.ranks):
            return end
        layout, buffer_bytes = link.layout, _FLOAT32 * link.n_buffers
        return LimitedTransport(end, self.bits_per_s, self.latency_s,
                                lambda reply: layout.reply_nbytes(reply.deltas, reply.part, reply.rejected)
                                + buffer_bytes)

    def __repr__(self) -> str:
        inner = "" if isinstance(self.inner, PointToPoint) else f", inner={self.inner!r}"
        ranks = "" if self.ranks is None else f", ranks={list(self.ranks)}"
        return f"{type(self).__name__}(bits_per_s={self.bits_per_s:g}, latency_s={self.latency_s:g}{ranks}{inner})"
