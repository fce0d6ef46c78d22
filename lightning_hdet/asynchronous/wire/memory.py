"""Every worker and rank 0's server in one process: the exchange's real messages, in wire order, copied through
queues (no process group), so one process runs whole rounds (each worker in its own thread where it would block):
``Exchange(..., transport=MemoryTransport())`` for every worker, ``outer=`` on worker 0's."""

from __future__ import annotations

import functools
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from lightning_hdet.asynchronous.wire.messages import Fragments, Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.network import Link, Transport
from lightning_hdet.asynchronous.wire.transport import (
    ServerTransport,
    StreamWorkerTransport,
    receive_buffer,
    receive_push,
    send_reply,
)


class MemoryTransport(Transport):
    """Queues between the workers and the server of one process (not picklable), counting the bytes each way by
    worker (:attr:`bytes`: ``"push"`` and ``"reply"``); an end waits ``timeout`` seconds, then raises."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._arrivals: queue.Queue[int] = queue.Queue()  # a worker whose push's header is on its way
        self._boxes: dict[tuple[str, int], queue.Queue[Tensor]] = {}
        self._lock = threading.Lock()
        self.bytes: dict[str, Counter[int]] = {"push": Counter(), "reply": Counter()}

    def server_end(self, link: Link) -> ServerTransport:
        return MemoryServerEnd(self, link.layout, link.n_buffers)

    def worker_end(self, link: Link, worker: int) -> MemoryWorkerEnd:
        return MemoryWorkerEnd(self, link.layout, worker)

    def put(self, way: str, worker: int, tensor: Tensor) -> None:
        """Send a copy of ``tensor`` one ``way`` for ``worker`` (the sender reuses it)."""
        self.bytes[way][worker] += tensor.numel() * tensor.element_size()
        self._box(way, worker).put(tensor.detach().clone())

    def take(self, way: str, worker: int, into: Tensor) -> None:
        """The next tensor sent ``way`` for ``worker``, into ``into`` (as many bytes)."""
        try:
            message = self._box(way, worker).get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"waited over {self.timeout} s for a {way} message of worker {worker}") from None
        # bytes travel, as over gloo: an uncompressed float32 fragment is received into a uint8 buffer
        sent, received = _bytes(message), _bytes(into)
        if sent.numel() != received.numel():
            raise RuntimeError(f"worker {worker}'s {way} message is {message.dtype}{list(message.shape)}, its"
                               f" receiver expected {received.numel()} bytes: the ends disagree on the layout")
        received.copy_(sent)

    def _box(self, way: str, worker: int) -> queue.Queue[Tensor]:
        with self._lock:
            return self._boxes.setdefault((way, worker), queue.Queue())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout:g})"


class MemoryWorkerEnd(StreamWorkerTransport):
    """A worker's end in this process."""

    def __init__(self, network: MemoryTransport, layout: Fragments, worker: int) -> None:
        super().__init__(layout, worker)
        self.network = network

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        self.network._arrivals.put(self.worker)  # the server's next receive may take it
        super().push(header, messages, buffers, inner_state)

    def send(self, tensor: Tensor) -> None:
        self.network.put("push", self.worker, tensor)

    def recv(self, tensor: Tensor) -> None:
        self.network.take("reply", self.worker, tensor)


class MemoryServerEnd(ServerTransport):
    """Rank 0's end in this process: pushes in the order they started."""

    def __init__(self, network: MemoryTransport, layout: Fragments, n_buffers: int) -> None:
        self.network, self.layout, self.n_buffers = network, layout, n_buffers
        self._received = receive_buffer(layout)

    def receive(self) -> tuple[Push, Iterator[Tensor]]:
        try:
            worker = self.network._arrivals.get(timeout=self.network.timeout)
        except queue.Empty:
            raise TimeoutError(f"the server waited over {self.network.timeout} s for a push") from None
        recv = functools.partial(self.network.take, "push", worker)
        return receive_push(worker, WorkerHeader.receive(recv), recv, self.layout, self.n_buffers, self._received)

    def reply(self, worker: int, header: ServerHeader, params: Iterable[Tensor], buffers: Tensor) -> None:
        send_reply(lambda tensor: self.network.put("reply", worker, tensor), header, params, buffers)


def _bytes(tensor: Tensor) -> Tensor:
    return tensor.view(-1).view(torch.uint8)
