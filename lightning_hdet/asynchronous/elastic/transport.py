"""The exchange's messages over one session's two-rank gloo group: the same wire format as the single-job mode
(:mod:`..messages`), the worker's end behind the same :class:`~..transport.WorkerTransport` interface, so the
unchanged :class:`~..worker.Worker` runs the round. Pushes travel on one tag and replies on another, so that the
server's receiving thread and its replies never wait on each other. Any failure of the group is a
:class:`~.membership.SessionLost`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_hdet.asynchronous.compression import Codec
from lightning_hdet.asynchronous.elastic.membership import SessionLost, first_line
from lightning_hdet.asynchronous.messages import Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.transport import WorkerTransport

PUSH_TAG, REPLY_TAG = 1, 2
_SERVER, _WORKER = 0, 1
T = TypeVar("T")


def _guarded(session: int, what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as err:  # gloo: peer closed, timeout, aborted
        raise SessionLost(f"session {session}: {what} failed: {first_line(err)}") from err


def _send(group: Any, tensor: Tensor, dst: int, tag: int) -> None:
    group.send([tensor.contiguous()], dst, tag).wait()


def _recv(group: Any, tensor: Tensor, src: int, tag: int) -> None:
    group.recv([tensor], src, tag).wait()


class SessionWorkerTransport(WorkerTransport):
    """A worker's end of its session (rank 1 of the session's group)."""

    def __init__(self, group: Any, session: int, n_params: int) -> None:
        self.group, self.session, self.n_params = group, session, n_params

    def push(self, header: WorkerHeader, payload: Tensor | None, inner_state: Tensor | None) -> None:
        def send() -> None:
            for part in (header.encode(), payload, inner_state):
                if part is not None:
                    _send(self.group, part, _SERVER, PUSH_TAG)
        _guarded(self.session, "push", send)

    def pull(self, into: Tensor) -> ServerHeader:
        def receive() -> ServerHeader:
            raw = torch.empty(ServerHeader.SIZE, dtype=torch.float64)
            _recv(self.group, raw, _SERVER, REPLY_TAG)
            header = ServerHeader.decode(raw)
            if header.next_local_steps > 0:
                _recv(self.group, into[: self.n_params], _SERVER, REPLY_TAG)
                if into.numel() > self.n_params:
                    _recv(self.group, into[self.n_params :], _SERVER, REPLY_TAG)
            return header
        return _guarded(self.session, "pull", receive)


class SessionServerEnd:
    """The server's end of one session (rank 0 of the session's group): receive its pushes, reply to it."""

    def __init__(self, group: Any, session: int, n_buffers: int, codec: Codec) -> None:
        self.group, self.session, self.n_buffers, self.codec = group, session, n_buffers, codec

    def receive(self) -> Push:
        def receive() -> Push:
            raw = torch.empty(WorkerHeader.SIZE, dtype=torch.float64)
            _recv(self.group, raw, _WORKER, PUSH_TAG)
            header = WorkerHeader.decode(raw)
            payload = inner_state = None
            if header.steps > 0:
                payload = torch.empty(self.codec.nbytes + 4 * self.n_buffers, dtype=torch.uint8)
                _recv(self.group, payload, _WORKER, PUSH_TAG)
            if header.inner_state_bytes > 0:
                inner_state = torch.empty(header.inner_state_bytes, dtype=torch.uint8)
                _recv(self.group, inner_state, _WORKER, PUSH_TAG)
            return Push.received(self.session, header, payload, self.codec, inner_state)
        return _guarded(self.session, "receive", receive)

    def reply(self, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        def send() -> None:
            _send(self.group, header.encode(), _WORKER, REPLY_TAG)
            if header.next_local_steps > 0:
                _send(self.group, params, _WORKER, REPLY_TAG)
                if buffers.numel():
                    _send(self.group, buffers, _WORKER, REPLY_TAG)
        _guarded(self.session, "reply", send)
