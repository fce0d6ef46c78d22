"""The outer service's I/O: its store, and two threads per session, one receiving and one replying.

Every session's receiving thread meets its worker in the session's group (on a store connection of its own),
then puts each push it receives into the service's inbox; its replying thread sends the service's answers. When
the group fails (worker killed, network gone, group aborted) either thread puts a :class:`Lost` there instead.
Nothing here blocks the service's loop on a worker: a frozen worker (joining, pushing or pulling) holds only its
own session's threads, so the loop keeps reading heartbeats and ends the session when its lease runs out. The
service's loop alone decides what a message means (:mod:`.service`); this module only moves bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Union

from torch import Tensor

from lightning_hdet.asynchronous.elastic.membership import (
    SessionLost,
    StoreHost,
    abort,
    first_line,
    session_group,
    session_key,
)
from lightning_hdet.asynchronous.elastic.transport import SessionServerEnd
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lost:
    """A session's group failed (its receiving thread saw the error)."""

    session: int
    reason: str


#: Seconds between a receiving thread's checks that its worker is ready to meet (or that its session ended).
MEET_POLL_S = 0.05
_FLUSH = object()  # in a replying thread's queue: send what is queued before it, then tear the group down


class SessionHub:
    """The store at ``address`` and the server's ends of the live sessions.

    Args:
        address: ``"host:port"`` to bind.
        config: published to the workers (sizes, codec, mode).
        next_id: the first session id to hand out.
        timeout: seconds any message may take (longer than any round).
        n_buffers: floating-point buffer values in a push.
        layout: the pushes' fragments and their codec.
    """

    def __init__(self, address: str, config: dict[str, Any], next_id: int, timeout: float, n_buffers: int,
                 layout: Fragments) -> None:
        self.host = StoreHost(address, config, next_id, timeout)
        self.timeout, self.n_buffers, self.layout = timeout, n_buffers, layout
        self.inbox: queue.Queue[Union[Push, Lost]] = queue.Queue()
        self._ends: dict[int, SessionServerEnd] = {}
        self._outboxes: dict[int, queue.Queue] = {}
        self._dropped: set[int] = set()
        self._threads: list[threading.Thread] = []  # replying threads and teardowns, joined by close()
        #: Sessions dropped because their worker stopped answering: their replying thread may be blocked for good.
        self._abandoned: set[int] = set()
        self._closing = threading.Event()
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.host.port

    def attach(self, session: int) -> None:
        """Start ``session``'s receiving thread (it first waits for the worker in the session's group)."""
        threading.Thread(target=self._receive, args=(session,), daemon=True, name=f"elastic-session-{session}").start()

    def _receive(self, session: int) -> None:
        try:
            store = self.host.client(self.timeout)
            if not self._worker_ready(store, session):
                return
            group = session_group(store, session, 0, self.host.host, self.timeout)
            end = SessionServerEnd(group, session, self.n_buffers, self.layout)
            with self._lock:
                dropped = session in self._dropped  # ended while the group formed: its worker must find out
                self._ends[session] = end
                self._outboxes[session] = outbox = queue.Queue()
            self._start(self._send_replies, session, end, outbox, name=f"elastic-reply-{session}")
            if dropped:
                self.drop(session)
                return
            while True:
                push = end.receive()
                self.inbox.put(push)
                if push.kind == Kind.BYE:
                    return
        except (SessionLost, RuntimeError) as err:  # group creation fails with a plain RuntimeError
            self.inbox.put(Lost(session, first_line(err)))

    def _worker_ready(self, store: Any, session: int) -> bool:
        """Wait until ``session``'s worker is about to meet the service; False once the session was dropped (its
        lease ran out before the worker met us) or the hub is closing."""
        while not store.check([session_key("meet", session)]):
            with self._lock:
                if session in self._dropped:
                    return False
            if self._closing.wait(MEET_POLL_S):
                return False
        return True

    def _send_replies(self, session: int, end: SessionServerEnd, outbox: queue.Queue) -> None:
        """Send ``session``'s replies in order until it is dropped (a frozen worker blocks this thread only)."""
        while (item := outbox.get()) is not None:
            if item is _FLUSH:
                abort(end.group)
                return
            try:
                end.reply(*item)
            except SessionLost as err:
                self.inbox.put(Lost(session, first_line(err)))
                return

    def reply(self, session: int, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        """Queue an answer to ``session`` (never blocks on the worker). ``params`` and ``buffers`` are copied now:
        the global model may change while the reply travels. A failed send arrives in the inbox as :class:`Lost`;
        raises :class:`SessionLost` when the session has no group."""
        with self._lock:
            outbox = self._outboxes.get(session)
        if outbox is None:
            raise SessionLost(f"session {session} has no group")
        sends_model = header.next_local_steps > 0  # a stop carries no model
        outbox.put((header, params.clone() if sends_model else params, buffers.clone() if sends_model else buffers))

    def drop(self, session: int, flush: bool = False, unresponsive: bool = False) -> None:
        """Forget ``session`` and tear its group down (its threads, if still waiting, then end); with ``flush``,
        only after the replies already queued were sent (a worker told to stop must hear it). ``unresponsive``:
        its worker stopped answering (lease expired, connection lost), so :meth:`close` does not wait for its
        replying thread."""
        with self._lock:
            end = self._ends.pop(session, None)
            outbox = self._outboxes.pop(session, None)
            self._dropped.add(session)
        if end is None:
            return
        assert outbox is not None
        if flush:
            outbox.put(_FLUSH)
            return
        outbox.put(None)
        if unresponsive:
            with self._lock:
                self._abandoned.add(session)
        # on its own thread: tearing down a group whose peer is frozen must not stall the loop
        self._start(abort, end.group, name=f"elastic-drop-{session}")

    def _start(self, target: Any, *args: Any, name: str) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads.append(thread)
        thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Tear down the sessions still open (none after a normal end; after a failure their threads would stay blocked
        on their groups), then wait (up to ``timeout`` seconds each) for the replying threads and the groups being torn
        down: a thread still inside a group's ``abort`` when the interpreter exits makes the C++ runtime terminate the
        process (seen: the service exited with SIGABRT, "terminate called without an active exception", after a normal
        end). Not waited for: the replying thread of a session dropped as unresponsive (lost or expired), which may be
        blocked for good in a send to a frozen worker (gloo's abort does not end a pending send); it is a daemon, as
        every session's receiving thread is, so it ends with the process. Every other replying thread is joined: one
        still sending when the process exits aborts it (seen after a normal leave). Waiting for it delayed the end of
        ``run()`` by ``timeout`` after a worker froze mid-exchange."""
        self._closing.set()
        with self._lock:
            still_open = list(self._ends)
        for session in still_open:
            self.drop(session)
        with self._lock:
            abandoned = {f"elastic-reply-{session}" for session in self._abandoned}
        for thread in list(self._threads):
            if thread.name not in abandoned:
                thread.join(timeout)
