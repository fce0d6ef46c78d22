"""How exchange messages travel: a small interface and its two implementations.

* :class:`WorkerTransport` is a worker's end: :meth:`~WorkerTransport.push` one message (header, buffers, inner
  state, then the pseudo-gradient's fragments as they are produced), then :meth:`~WorkerTransport.pull` the reply
  into a flat host buffer.
* :class:`ServerTransport` is the server's end for remote workers: :meth:`~ServerTransport.receive` the next
  message from any of them (its fragments arrive one at a time, into one fragment-sized buffer),
  :meth:`~ServerTransport.reply` to one, fragment by fragment.

:class:`GlooWorkerTransport` / :class:`GlooServerTransport` carry them point to point over two ``gloo``
process groups (one for pushes, one for replies, so that rank 0's receiver and server threads never share a
group). Rank 0's own worker talks to its server through :class:`InProcessTransport` (queues, no copies over a
network). Any other implementation of these two classes (the in-memory one of :mod:`.memory`, the elastic
sessions', another engine's) plugs into :class:`~lightning_hdet.asynchronous.exchange.server.Server` and
:class:`~lightning_hdet.asynchronous.exchange.worker.Worker` unchanged; :class:`StreamWorkerTransport` is a worker's
end over any ordered stream of tensors. The strategy is given a :class:`~.network.Transport`, which builds the ends.
The byte layout is in :mod:`~lightning_hdet.asynchronous.wire.messages`.
"""

from __future__ import annotations

import functools
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet.asynchronous.wire.messages import Fragments, Push, ServerHeader, WorkerHeader


class WorkerTransport(ABC):
    """A worker's end of the exchange."""

    @abstractmethod
    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        """Send one message: ``buffers`` (``float32`` values) and the encoded fragments ``messages`` (``uint8``,
        produced one at a time; each may be overwritten once the next is asked for) when ``header.steps > 0``,
        ``inner_state`` when ``header.inner_state_bytes > 0``."""

    @abstractmethod
    def pull(self, into: Tensor) -> ServerHeader:
        """Wait for the reply; unless it says stop, the global parameters then buffers land in ``into``."""

    def close(self) -> None:
        """Let go of what carries the messages once the exchange has ended (nothing to release by default)."""


class ServerTransport(ABC):
    """The server's end of the exchange with the remote workers."""

    @abstractmethod
    def receive(self) -> tuple[Push, Iterator[Tensor]]:
        """The next message from any remote worker (blocks): its :class:`Push` (header, buffers, inner state) and
        an iterator over its encoded fragments, which must be consumed, each before the next, before the next
        :meth:`receive`."""

    @abstractmethod
    def reply(self, worker: int, header: ServerHeader, params: Iterable[Tensor], buffers: Tensor) -> None:
        """Answer ``worker``; the parameters' fragments ``params`` and the ``buffers`` travel only when
        ``header.next_local_steps > 0``."""

    def close(self) -> None:
        """Let go of what carries the messages once the exchange has ended (nothing to release by default)."""


#: Takes a piece of a reply's global model: the reply, the piece's first index in the flat model, its values.
Combine = Callable[[ServerHeader, int, Tensor], None]

#: Sends one tensor to the peer / receives one tensor from it (a process group's point-to-point call).
Send = Callable[[Tensor], None]
Recv = Callable[[Tensor], None]


def send_push(send: Send, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
              inner_state: Tensor | None) -> None:
    """A push in wire order: the header, the buffers, the inner state, then the fragments as they are produced."""
    send(header.encode())
    for part in (buffers, inner_state):
        if part is not None:
            send(part)
    for message in messages:
        send(message)


def receive_push(worker: int, header: WorkerHeader, recv: Recv, layout: Fragments, n_buffers: int,
                 received: Tensor) -> tuple[Push, Iterator[Tensor]]:
    """The rest of a push whose ``header`` arrived: its buffers and inner state, and an iterator receiving its
    fragments one at a time into ``received`` (one fragment-sized buffer, reused)."""
    buffers = inner_state = None
    if header.steps > 0 and n_buffers:
        buffers = torch.empty(n_buffers, dtype=torch.float32)
        recv(buffers)
    if header.inner_state_bytes > 0:
        inner_state = torch.empty(header.inner_state_bytes, dtype=torch.uint8)
        recv(inner_state)
    push = Push.of(worker, header, buffers, inner_state, layout.part_nbytes(header.part))
    return push, _fragments(recv, layout, received, header.part) if header.steps > 0 else iter(())


def _fragments(recv: Recv, layout: Fragments, received: Tensor, part: int) -> Iterator[Tensor]:
    for i in layout.indices(part):
        message = received[: layout.codecs[i].nbytes]
        recv(message)
        yield message


def send_reply(send: Send, header: ServerHeader, params: Iterable[Tensor], buffers: Tensor) -> None:
    """A reply in wire order: the header, then (unless it says stop) the parameters' fragments and the buffers."""
    send(header.encode())
    if header.next_local_steps > 0:
        for part in params:
            send(part)
        if buffers.numel():
            send(buffers)


def receive_reply(recv: Recv, layout: Fragments, into: Tensor, message: Tensor, scratch: Tensor | None = None,
                  own: tuple[int, Sequence[Tensor]] | None = None) -> ServerHeader:
    """A reply: its header and, unless it says stop, the global parameters (each encoded fragment received into
    ``message``, :meth:`~.messages.Fragments.pull_buffer`, and decoded into place; ``float32`` ones straight into
    place) or the public model's changes (each decoded into ``scratch``, a buffer of the largest fragment, and added
    to the version ``into`` holds), then buffers into ``into``. ``own``: this worker and its last push's messages
    (:func:`keep_sent`), which fill the slot a forwarded round leaves out (:meth:`~.messages.Fragments.skips_own`)."""
    raw = torch.empty(ServerHeader.SIZE, dtype=torch.float64)
    recv(raw)
    header = ServerHeader.decode(raw)
    if header.next_local_steps > 0:
        if header.deltas >= 0:
            scratch = torch.empty(layout.largest, dtype=torch.float32) if scratch is None else scratch
            skips = layout.skips_own(header.deltas, header.rejected)
            for change in range(header.deltas):  # oldest first, as rank 0 added them to its copy
                for index, (codec, part) in enumerate(zip(layout.delta_codecs, layout.split(into))):
                    received = message[: codec.nbytes]
                    if skips and change == header.deltas - 1:
                        _receive_around_own(recv, layout, index, received, own)
                    else:
                        recv(received)
                    part.add_(codec.decode(received, scratch[: codec.numel]))
        else:
            _receive_params(recv, layout, into, message, header.part)
        if into.numel() > layout.numel:
            recv(into[layout.numel :])
    return header


def _receive_around_own(recv: Recv, layout: Fragments, index: int, message: Tensor,
                        own: tuple[int, Sequence[Tensor]] | None) -> None:
    """Fragment ``index`` of a round change that left out this worker's slot: the rest received around it, the
    slot written with the bytes this worker pushed (those rank 0 forwarded to the others)."""
    if own is None:
        raise RuntimeError("A pull left out this worker's slot of the round, but its transport kept no push.")
    worker, sent = own
    codec = layout.round_codecs[index]
    for piece in codec.around(message, worker):
        recv(piece)
    codec.slot(message, worker).copy_(sent[index])


def keep_sent(messages: Iterable[Tensor], sent: Sequence[Tensor]) -> Iterator[Tensor]:
    """``messages`` (a push's fragments, in order) passed on, each copied into ``sent`` first (the sender reuses
    its buffer): what fills this worker's slot of its next pull (:func:`receive_reply`)."""
    for index, message in enumerate(messages):
        sent[index].copy_(message)
        yield message


def _receive_params(recv: Recv, layout: Fragments, into: Tensor, message: Tensor, part: int) -> None:
    """The global parameters (of ``part``) in the pull codec, into place fragment by fragment."""
    for i, values in zip(layout.indices(part), layout.split(into, part)):
        codec = layout.pull_codecs[i]
        if codec.raw:  # its messages are the values' own bytes: straight into place
            recv(values)
        else:
            recv(message[: codec.nbytes])
            codec.decode(message[: codec.nbytes], values)


def receive_buffer(layout: Fragments) -> Tensor:
    """One buffer the size of the largest encoded fragment (every fragment of every push lands in it)."""
    return torch.empty(max((c.nbytes for c in layout.codecs), default=0), dtype=torch.uint8)


class StreamWorkerTransport(WorkerTransport):
    """A worker's end over an ordered stream of tensors to and from the server: a subclass sends and receives one
    tensor (:meth:`send`, :meth:`recv`); this class puts a push and a reply in wire order and keeps what a forwarded
    round needs. Worker ``worker`` at the server."""

    def __init__(self, layout: Fragments, worker: int) -> None:
        self.layout, self.worker = layout, worker
        self._message = layout.pull_buffer()
        # a delta pull codec's changes are decoded here before they are added (empty without one)
        self._scratch = torch.empty(layout.largest if layout.delta_codecs else 0, dtype=torch.float32)
        # forwarded rounds (outer="sparseloco"): the last push's messages, this worker's slot of its next pull
        self._sent = [torch.empty(c.codec.nbytes, dtype=torch.uint8) for c in layout.round_codecs]

    @abstractmethod
    def send(self, tensor: Tensor) -> None:
        """Send one tensor of a push to the server (it may be overwritten once this returns)."""

    @abstractmethod
    def recv(self, tensor: Tensor) -> None:
        """Receive the server's next tensor of a reply into ``tensor``."""

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        messages = keep_sent(messages, self._sent) if self._sent else messages
        send_push(self.send, header, messages, buffers, inner_state)

    def pull(self, into: Tensor) -> ServerHeader:
        return receive_reply(self.recv, self.layout, into, self._message, self._scratch, (self.worker, self._sent))


class GlooWorkerTransport(StreamWorkerTransport):
    """A remote worker (rank > 0), worker ``worker`` at the server: point-to-point messages to and from rank 0
    over two ``gloo`` groups."""

    def __init__(self, push_group: Any, reply_group: Any, layout: Fragments, worker: int) -> None:
        super().__init__(layout, worker)
        self.push_group, self.reply_group = push_group, reply_group

    def send(self, tensor: Tensor) -> None:
        dist.send(tensor, dst=0, group=self.push_group)

    def recv(self, tensor: Tensor) -> None:
        dist.recv(tensor, src=0, group=self.reply_group)

    def close(self) -> None:
        """Drop the references to the groups: a gloo group's native threads end only when its last reference goes
        (the strategy destroys the groups; an exchange kept for its read-outs must not keep them alive)."""
        self.push_group = self.reply_group = None


class GlooServerTransport(ServerTransport):
    """Rank 0's end for the remote workers: receives from any rank, replies point to point. Fragments land in one
    fragment-sized receive buffer, reused for every fragment of every push. With workers of ``ranks_per_worker``
    ranks, worker ``w`` is its leader, rank ``w * ranks_per_worker`` (see :mod:`.ranks`)."""

    def __init__(self, push_group: Any, reply_group: Any, layout: Fragments, n_buffers: int,
                 ranks_per_worker: int = 1) -> None:
        self.push_group, self.reply_group, self.layout, self.n_buffers = push_group, reply_group, layout, n_buffers
        self.ranks_per_worker = ranks_per_worker
        self._received = receive_buffer(layout)

    def receive(self) -> tuple[Push, Iterator[Tensor]]:
        raw = torch.empty(WorkerHeader.SIZE, dtype=torch.float64)
        src = dist.recv(raw, src=None, group=self.push_group)
        return receive_push(src // self.ranks_per_worker, WorkerHeader.decode(raw),
                            lambda t: dist.recv(t, src=src, group=self.push_group), self.layout, self.n_buffers,
                            self._received)

    def reply(self, worker: int, header: ServerHeader, params: Iterable[Tensor], buffers: Tensor) -> None:
        leader = worker * self.ranks_per_worker
        send_reply(lambda t: dist.send(t, dst=leader, group=self.reply_group), header, params, buffers)

    def close(self) -> None:
        """Drop the references to the groups: a gloo group's native threads end only when its last reference goes
        (the strategy destroys the groups; an exchange kept for its read-outs must not keep them alive)."""
        self.push_group = self.reply_group = None


class InProcessTransport(WorkerTransport):
    """Rank 0's own worker and the server in the same process: each pushed fragment is handed to the server as
    it is produced (``accept`` applies it; nothing is copied or queued), and a pull copies the global model
    straight into the worker's buffer.

    Args:
        accept: the server's entry for a push and its fragments (it consumes them before returning).
        read_model: the server's copy of the global model (the parameters of a part, and the buffers) into a
            worker's buffer (or handed piece by piece to a function of ``(start, values)``); returns the version
            copied.
        timeout: seconds to wait for a reply.
        check: raises if the server failed (called around every wait, so the training thread sees it).
        worker: the worker id this transport speaks for (rank 0).
        gradient_bytes: bytes of one encoded pseudo-gradient of a part (``-1``: whole; counted in ``push_bytes``).
    """

    def __init__(self, accept: Callable[[Push, Iterable[Tensor]], None],
                 read_model: Callable[[int, Tensor, Callable[[int, Tensor], None] | None, int], int],
                 timeout: float, check: Callable[[], None], worker: int = 0,
                 gradient_bytes: Callable[[int], int] = lambda part: 0) -> None:
        self.accept, self.read_model, self.timeout, self.check = accept, read_model, timeout, check
        self.worker, self.gradient_bytes = worker, gradient_bytes
        self._replies: queue.Queue[ServerHeader] = queue.Queue()

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        self.check()
        # the buffers are copied: the server keeps them, and the worker reuses its buffer
        buffers = buffers.clone() if buffers is not None else None
        self.accept(Push.of(self.worker, header, buffers, inner_state, self.gradient_bytes(header.part)), messages)

    def pull(self, into: Tensor, combine: Combine | None = None) -> ServerHeader:
        """Wait for the reply, then copy the global model into ``into``; or, with ``combine``, hand it over piece by
        piece instead (``combine(reply, start, values)``: the values from index ``start`` of the flat parameters then
        buffers; an overlapping worker merges them in place, see :mod:`.overlapped`)."""
        header = self._replies.get(timeout=self.timeout)
        self.check()
        if header.next_local_steps > 0:
            pieces = None if combine is None else functools.partial(combine, header)
            version = self.read_model(self.worker, into, pieces, header.part)
            header = replace(header, outer_updates=version)
        return header

    def reply(self, header: ServerHeader) -> None:
        """The server's side: the in-process worker may go on (its :meth:`pull` copies the global model)."""
        self._replies.put(header)

    def wake(self) -> None:
        """Wake a waiting :meth:`pull` (the server failed; :meth:`pull` then raises through ``check``)."""
        self._replies.put(ServerHeader(0, 0))
