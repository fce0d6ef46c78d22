"""The outer service's I/O: its store and one receiving thread per session.

Every session's thread meets its worker in the session's group, then puts each push it receives into the
service's inbox; when the group fails (worker killed, network gone, group aborted) it puts a :class:`Lost` there
instead. The service's loop alone decides what a message means (:mod:`.service`); this module only moves bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Union

from torch import Tensor

from lightning_hdet.asynchronous.elastic.membership import SessionLost, StoreHost, abort, first_line, session_group
from lightning_hdet.asynchronous.elastic.transport import SessionServerEnd
from lightning_hdet.asynchronous.messages import Fragments, Kind, Push, ServerHeader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lost:
    """A session's group failed (its receiving thread saw the error)."""

    session: int
    reason: str


Inbox = "queue.Queue[Union[Push, Lost]]"


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
        self._dropped: set[int] = set()
        self._teardowns: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        return self.host.port

    def registered(self) -> int:
        """The largest session id handed out so far."""
        return self.host.registered()

    def beats(self, session: int) -> int:
        return self.host.beats(session)

    def attach(self, session: int) -> None:
        """Start ``session``'s receiving thread (it first waits for the worker in the session's group)."""
        threading.Thread(target=self._receive, args=(session,), daemon=True, name=f"elastic-session-{session}").start()

    def _receive(self, session: int) -> None:
        try:
            group = session_group(self.host.store, session, 0, self.host.host, self.timeout)
            end = SessionServerEnd(group, session, self.n_buffers, self.layout)
            with self._lock:
                dropped = session in self._dropped  # ended while the group formed: its worker must find out
                self._ends[session] = end
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

    def reply(self, session: int, header: ServerHeader, params: Tensor, buffers: Tensor) -> None:
        """Answer ``session`` (raises :class:`SessionLost` when it is gone)."""
        with self._lock:
            end = self._ends.get(session)
        if end is None:
            raise SessionLost(f"session {session} has no group")
        end.reply(header, params, buffers)

    def drop(self, session: int) -> None:
        """Forget ``session`` and tear its group down (its thread, if still waiting, then ends)."""
        with self._lock:
            end = self._ends.pop(session, None)
            self._dropped.add(session)
        if end is not None:  # on its own thread: tearing down a group whose peer is frozen must not stall the loop
            teardown = threading.Thread(target=abort, args=(end.group,), daemon=True, name=f"elastic-drop-{session}")
            self._teardowns.append(teardown)
            teardown.start()

    def close(self, timeout: float = 30.0) -> None:
        """Tear down the sessions still open (none after a normal end; after a failure their receiving threads would
        stay blocked on their groups), then wait (up to ``timeout`` seconds each) for the groups being torn down: a
        thread still inside a group's ``abort`` when the interpreter exits makes the C++ runtime terminate the process
        (seen: the service exited with SIGABRT, "terminate called without an active exception", after a normal end)."""
        with self._lock:
            still_open = list(self._ends)
        for session in still_open:
            self.drop(session)
        for teardown in self._teardowns:
            teardown.join(timeout)
