"""How exchange messages travel: a small interface and its two implementations.

* :class:`WorkerTransport` is a worker's end: :meth:`~WorkerTransport.push` one message (header, flat payload,
  inner state), then :meth:`~WorkerTransport.pull` the reply into a flat host buffer.
* :class:`ServerTransport` is the server's end for remote workers: :meth:`~ServerTransport.receive` the next
  message from any of them, :meth:`~ServerTransport.reply` to one.

:class:`GlooWorkerTransport` / :class:`GlooServerTransport` carry them point to point over two ``gloo``
process groups (one for pushes, one for replies, so that rank 0's receiver and server threads never share a
group). Rank 0's own worker talks to its server through :class:`InProcessTransport` (queues, no copies over a
network). Any other implementation of these two classes (an in-memory fake in the tests; later, workers that are
separate jobs) plugs into :class:`~lightning_hdet.asynchronous.server.Server` and
:class:`~lightning_hdet.asynchronous.worker.Worker` unchanged. The byte layout is in
:mod:`~lightning_hdet.asynchronous.messages`.
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet.asynchronous.messages import Push, ServerHeader, WorkerHeader


class WorkerTransport(ABC):
    """A worker's end of the exchange."""

    @abstractmethod
    def push(self, header: WorkerHeader, payload: Tensor | None, inner_state: Tensor | None) -> None:
        """Send one message: ``payload`` (pseudo-gradient, then buffer values) when ``header.steps > 0``,
        ``inner_state`` when ``header.inner_state_bytes > 0``. The caller may reuse ``payload`` once it returns."""

    @abstractmethod
    def pull(self, into: Tensor) -> ServerHeader:
        """Wait for the reply; unless it says stop, the global parameters then buffers land in ``into``."""


class ServerTransport(ABC):
    """The server's end of the exchange with the remote workers."""

    @abstractmethod
    def receive(self) -> Push:
        """The next message from any remote worker (blocks)."""

    @abstractmethod
    def reply(self, worker: int, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        """Answer ``worker``; ``params`` and ``buffers`` (flat) travel only when ``header.next_local_steps > 0``."""


class GlooWorkerTransport(WorkerTransport):
    """A remote worker (rank > 0): point-to-point messages to and from rank 0 over two ``gloo`` groups."""

    def __init__(self, push_group: Any, reply_group: Any, n_params: int) -> None:
        self.push_group, self.reply_group, self.n_params = push_group, reply_group, n_params

    def push(self, header: WorkerHeader, payload: Tensor | None, inner_state: Tensor | None) -> None:
        dist.send(header.encode(), dst=0, group=self.push_group)
        for part in (payload, inner_state):
            if part is not None:
                dist.send(part, dst=0, group=self.push_group)

    def pull(self, into: Tensor) -> ServerHeader:
        raw = torch.empty(ServerHeader.SIZE, dtype=torch.float64)
        dist.recv(raw, src=0, group=self.reply_group)
        header = ServerHeader.decode(raw)
        if header.next_local_steps > 0:
            dist.recv(into[: self.n_params], src=0, group=self.reply_group)
            if into.numel() > self.n_params:
                dist.recv(into[self.n_params :], src=0, group=self.reply_group)
        return header


class GlooServerTransport(ServerTransport):
    """Rank 0's end for the remote workers: receives from any rank, replies point to point."""

    def __init__(self, push_group: Any, reply_group: Any, n_params: int, n_buffers: int) -> None:
        self.push_group, self.reply_group = push_group, reply_group
        self.n_params, self.n_buffers = n_params, n_buffers

    def receive(self) -> Push:
        raw = torch.empty(WorkerHeader.SIZE, dtype=torch.float64)
        src = dist.recv(raw, src=None, group=self.push_group)
        header = WorkerHeader.decode(raw)
        payload = inner_state = None
        if header.steps > 0:
            payload = torch.empty(self.n_params + self.n_buffers, dtype=torch.float32)
            dist.recv(payload, src=src, group=self.push_group)
        if header.inner_state_bytes > 0:
            inner_state = torch.empty(header.inner_state_bytes, dtype=torch.uint8)
            dist.recv(inner_state, src=src, group=self.push_group)
        return Push.received(src, header, payload, self.n_params, inner_state)

    def reply(self, worker: int, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        dist.send(header.encode(), dst=worker, group=self.reply_group)
        if header.next_local_steps > 0:
            dist.send(params, dst=worker, group=self.reply_group)
            if buffers.numel():
                dist.send(buffers, dst=worker, group=self.reply_group)


class InProcessTransport(WorkerTransport):
    """Rank 0's own worker and the server in the same process: pushes go straight into the server's inbox,
    replies come back through a queue.

    Args:
        inbox: the server's queue of received pushes.
        n_params: parameters in the flat payload (the rest are buffer values).
        timeout: seconds to wait for a reply.
        check: raises if the server failed (called around every wait, so the training thread sees it).
        worker: the worker id this transport speaks for (rank 0).
    """

    def __init__(self, inbox: queue.Queue[Push], n_params: int, timeout: float, check: Callable[[], None],
                 worker: int = 0) -> None:
        self.inbox, self.n_params, self.timeout, self.check, self.worker = inbox, n_params, timeout, check, worker
        self._replies: queue.Queue[tuple[ServerHeader, Tensor | None]] = queue.Queue()

    def push(self, header: WorkerHeader, payload: Tensor | None, inner_state: Tensor | None) -> None:
        self.check()
        # a copy: the worker reuses its payload buffer while the server may still hold this push
        copied = payload.clone() if payload is not None else None
        self.inbox.put(Push.received(self.worker, header, copied, self.n_params, inner_state))

    def pull(self, into: Tensor) -> ServerHeader:
        header, state = self._replies.get(timeout=self.timeout)
        self.check()
        if state is not None:
            into.copy_(state)
        return header

    def reply(self, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        """The server's side: answer the in-process worker (a snapshot of the global model)."""
        self._replies.put((header, torch.cat([params, buffers]) if header.next_local_steps > 0 else None))

    def wake(self) -> None:
        """Wake a waiting :meth:`pull` (the server failed; :meth:`pull` then raises through ``check``)."""
        self._replies.put((ServerHeader(0, 0), None))
