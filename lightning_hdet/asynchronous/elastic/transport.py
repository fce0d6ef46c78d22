"""The exchange's messages over one session's two-rank gloo group: the same wire format as the single-job mode
(:mod:`..messages`, sent and received by the same functions as the single-job transports), the worker's end a
:class:`~..transport.StreamWorkerTransport` like the others, so the unchanged :class:`~..worker.Worker` runs the round.
Pushes travel on one tag and replies on another, so that the server's receiving thread and its replies never wait on
each other. Any failure of the group is a :class:`~.membership.SessionLost`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeVar

from torch import Tensor

from lightning_hdet.asynchronous.elastic.membership import SessionLost, first_line
from lightning_hdet.asynchronous.wire.messages import Fragments, Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import StreamWorkerTransport, receive_buffer, receive_push, send_reply

PUSH_TAG, REPLY_TAG = 1, 2
_SERVER, _WORKER = 0, 1
T = TypeVar("T")


def _guarded(session: int, what: str, call: Callable[[], T]) -> T:
    try:
        return call()
    except RuntimeError as err:  # gloo: peer closed, timeout, aborted
        raise SessionLost(f"session {session}: {what} failed: {first_line(err)}") from err


def _send(group: Any, tensor: Tensor, *, dst: int, tag: int) -> None:
    group.send([tensor.contiguous()], dst, tag).wait()


def _recv(group: Any, tensor: Tensor, *, src: int, tag: int) -> None:
    group.recv([tensor], src, tag).wait()


class SessionWorkerTransport(StreamWorkerTransport):
    """A worker's end of its session (rank 1 of the session's group)."""

    def __init__(self, group: Any, session: int, layout: Fragments) -> None:
        super().__init__(layout, worker=session)
        self.group, self.session = group, session

    def send(self, tensor: Tensor) -> None:
        _send(self.group, tensor, dst=_SERVER, tag=PUSH_TAG)

    def recv(self, tensor: Tensor) -> None:
        _recv(self.group, tensor, src=_SERVER, tag=REPLY_TAG)

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        _guarded(self.session, "push",
                 lambda: StreamWorkerTransport.push(self, header, messages, buffers, inner_state))

    def pull(self, into: Tensor) -> ServerHeader:
        return _guarded(self.session, "pull", lambda: StreamWorkerTransport.pull(self, into))


class SessionServerEnd:
    """The server's end of one session (rank 0 of the session's group): receive its pushes, reply to it.

    A push is received whole (its fragments decoded into one flat pseudo-gradient) before the service sees it:
    a worker lost in the middle of a push leaves no trace in the outer state (its unfinished round is discarded).
    """

    def __init__(self, group: Any, session: int, n_buffers: int, layout: Fragments) -> None:
        self.group, self.session, self.n_buffers, self.layout = group, session, n_buffers, layout
        self._received = receive_buffer(layout)
        self._reply = layout.pull_buffer()

    def receive(self) -> Push:
        def receive() -> Push:
            recv = partial(_recv, self.group, src=_WORKER, tag=PUSH_TAG)
            push, messages = receive_push(self.session, WorkerHeader.receive(recv), recv, self.layout, self.n_buffers,
                                          self._received)
            if push.steps > 0:
                push.pseudo_gradient = self.layout.join(messages)
            return push
        return _guarded(self.session, "receive", receive)

    def reply(self, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        send = partial(_send, self.group, dst=_WORKER, tag=REPLY_TAG)
        messages = self.layout.encode_pull(params, self._reply)
        _guarded(self.session, "reply", lambda: send_reply(send, header, messages, buffers))
