"""The two ends of the exchange (:class:`WorkerTransport`, :class:`ServerTransport`), the wire order over any
stream of tensors (:func:`send_push`, :func:`receive_reply`, ...), the ``gloo`` point-to-point ends and rank 0's
in-process end. Any other implementation (:mod:`.memory`, the elastic sessions', another engine's) plugs into the
server and worker unchanged; :mod:`.network` builds them."""

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
        """Send one message (``messages``: encoded fragments, each may be overwritten once the next is asked for)."""

    @abstractmethod
    def pull(self, into: Tensor) -> ServerHeader:
        """Wait for the reply; unless it says stop, the global parameters then buffers land in ``into``."""

    def close(self) -> None:
        """Let go of what carries the messages once the exchange has ended."""


class ServerTransport(ABC):
    """The server's end of the exchange with the remote workers."""

    @abstractmethod
    def receive(self) -> tuple[Push, Iterator[Tensor]]:
        """The next message from any remote worker and an iterator over its fragments (consume it first)."""

    @abstractmethod
    def reply(self, worker: int, header: ServerHeader, params: Iterable[Tensor], buffers: Tensor) -> None:
        """Answer ``worker`` (``params`` and ``buffers`` travel unless the header says stop)."""

    def close(self) -> None:
        """Let go of what carries the messages once the exchange has ended."""


#: Takes a piece of a reply's global model: the reply, the piece's first index in the flat model, its values.
Combine = Callable[[ServerHeader, int, Tensor], None]
Send = Callable[[Tensor], None]
Recv = Callable[[Tensor], None]


def send_push(send: Send, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
              inner_state: Tensor | None) -> None:
    """A push in wire order."""
    send(header.encode())
    for part in (buffers, inner_state):
        if part is not None:
            send(part)
    for message in messages:
        send(message)


def receive_push(worker: int, header: WorkerHeader, recv: Recv, layout: Fragments, n_buffers: int,
                 received: Tensor) -> tuple[Push, Iterator[Tensor]]:
    """The rest of a push whose ``header`` arrived, its fragments received one at a time into ``received``."""
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
    """A reply in wire order."""
    send(header.encode())
    if header.next_local_steps > 0:
        for part in params:
            send(part)
        if buffers.numel():
            send(buffers)


def receive_reply(recv: Recv, layout: Fragments, into: Tensor, message: Tensor, scratch: Tensor | None = None,
                  own: tuple[int, Sequence[Tensor]] | None = None) -> ServerHeader:
    """A reply into ``into``: the parameters (decoded through ``message``; float32 straight into place) or the
    public model's changes (decoded into ``scratch``, added to ``into``), then the buffers. ``own``: this worker and
    its last push's messages, for the slot a forwarded round leaves out (:meth:`~.messages.Fragments.skips_own`)."""
    header = ServerHeader.receive(recv)
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
            for i, values in zip(layout.indices(header.part), layout.split(into, header.part)):
                codec = layout.pull_codecs[i]
                if codec.raw:  # its messages are the values' own bytes: straight into place
                    recv(values)
                else:
                    recv(message[: codec.nbytes])
                    codec.decode(message[: codec.nbytes], values)
        if into.numel() > layout.numel:
            recv(into[layout.numel :])
    return header


def _receive_around_own(recv: Recv, layout: Fragments, index: int, message: Tensor,
                        own: tuple[int, Sequence[Tensor]] | None) -> None:
    """Fragment ``index`` of a round change without this worker's slot, the slot filled with its own push."""
    if own is None:
        raise RuntimeError("A pull left out this worker's slot of the round, but its transport kept no push.")
    worker, sent = own
    codec = layout.round_codecs[index]
    for piece in codec.around(message, worker):
        recv(piece)
    codec.slot(message, worker).copy_(sent[index])


def keep_sent(messages: Iterable[Tensor], sent: Sequence[Tensor]) -> Iterator[Tensor]:
    """``messages`` passed on, each copied into ``sent`` first (this worker's slot of its next pull)."""
    for index, message in enumerate(messages):
        sent[index].copy_(message)
        yield message


def receive_buffer(layout: Fragments) -> Tensor:
    return torch.empty(max((c.nbytes for c in layout.codecs), default=0), dtype=torch.uint8)


class StreamWorkerTransport(WorkerTransport):
    """A worker's end over an ordered stream of tensors: a subclass gives :meth:`send` and :meth:`recv`."""

    def __init__(self, layout: Fragments, worker: int) -> None:
        self.layout, self.worker = layout, worker
        self._message = layout.pull_buffer()
        # a delta pull codec's changes are decoded here before they are added (empty without one)
        self._scratch = torch.empty(layout.largest if layout.delta_codecs else 0, dtype=torch.float32)
        # forwarded rounds (outer="sparseloco"): the last push's messages, this worker's slot of its next pull
        self._sent = [torch.empty(c.codec.nbytes, dtype=torch.uint8) for c in layout.round_codecs]

    @abstractmethod
    def send(self, tensor: Tensor) -> None:
        """Send one tensor (it may be overwritten once this returns)."""

    @abstractmethod
    def recv(self, tensor: Tensor) -> None:
        """Receive the server's next tensor into ``tensor``."""

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        messages = keep_sent(messages, self._sent) if self._sent else messages
        send_push(self.send, header, messages, buffers, inner_state)

    def pull(self, into: Tensor) -> ServerHeader:
        return receive_reply(self.recv, self.layout, into, self._message, self._scratch, (self.worker, self._sent))


class GlooWorkerTransport(StreamWorkerTransport):
    """A remote worker's end: point to point to and from rank 0 over two ``gloo`` groups."""

    def __init__(self, push_group: Any, reply_group: Any, layout: Fragments, worker: int) -> None:
        super().__init__(layout, worker)
        self.push_group, self.reply_group = push_group, reply_group

    def send(self, tensor: Tensor) -> None:
        dist.send(tensor, dst=0, group=self.push_group)

    def recv(self, tensor: Tensor) -> None:
        dist.recv(tensor, src=0, group=self.reply_group)

    def close(self) -> None:
        # a gloo group's native threads end only with its last reference: an exchange kept for its read-outs
        # must not keep them alive
        self.push_group = self.reply_group = None


class GlooServerTransport(ServerTransport):
    """Rank 0's end: receives from any rank, replies point to point (worker ``w``'s leader is ``w * k``)."""

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

    close = GlooWorkerTransport.close


class InProcessTransport(WorkerTransport):
    """Rank 0's own worker's end: each pushed fragment is handed to the server's ``accept`` as it is produced
    (nothing copied or queued) and a pull copies the global model through ``read_model`` (which returns the version).
    ``check`` raises if the server failed; ``gradient_bytes(part)``: what a push counts in ``push_bytes``."""

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
        """Wait for the reply, then copy the global model into ``into`` (or piece by piece to ``combine``)."""
        header = self._replies.get(timeout=self.timeout)
        self.check()
        if header.next_local_steps > 0:
            pieces = None if combine is None else functools.partial(combine, header)
            version = self.read_model(self.worker, into, pieces, header.part)
            header = replace(header, outer_updates=version)
        return header

    def reply(self, header: ServerHeader) -> None:
        """The server's side: the in-process worker may go on."""
        self._replies.put(header)

    def wake(self) -> None:
        """Wake a waiting :meth:`pull` (the server failed: it then raises)."""
        self._replies.put(ServerHeader(0, 0))
