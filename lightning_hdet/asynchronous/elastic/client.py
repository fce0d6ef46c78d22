"""A worker's connection to the outer service: one session at a time, reopened with back-off when it is lost.

When the server is gone (killed, restarting from its checkpoint, network down), :meth:`SessionClient.reopen`
tries to register again for up to ``reconnect_s`` seconds, waiting :func:`~.sessions.backoff` between attempts,
and raises a :class:`RuntimeError` naming the server once that time has passed (``reconnect_s=0``: fail fast).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_hdet.asynchronous.elastic.membership import Registration, SessionLost
from lightning_hdet.asynchronous.elastic.sessions import backoff
from lightning_hdet.asynchronous.elastic.transport import SessionWorkerTransport
from lightning_hdet.asynchronous.wire.messages import Fragments

log = logging.getLogger(__name__)


class SessionClient:
    """One worker's sessions with the service at ``address``.

    Args:
        address: the service's ``"host:port"``.
        reconnect_s: seconds to keep trying to open a session before giving up.
        heartbeat_s: seconds between heartbeats.
        timeout_s: seconds any message may take.
        token: the service's shared secret, if it requires one (a refusal is not retried).
    """

    def __init__(self, address: str, reconnect_s: float, heartbeat_s: float, timeout_s: float,
                 token: str | None = None) -> None:
        self.address, self.reconnect_s, self.heartbeat_s, self.timeout_s = address, reconnect_s, heartbeat_s, timeout_s
        self.token = token
        self.registration: Registration | None = None

    def transport(self, layout: Fragments) -> SessionWorkerTransport:
        """The current session's transport, for pushes in ``layout``."""
        assert self.registration is not None
        return SessionWorkerTransport(self.registration.group, self.registration.session, layout)

    def reopen(self) -> tuple[int, dict[str, Any]]:
        """Close the current session (if any) and open a new one, retrying with back-off; its id and config."""
        self.close()
        deadline, attempt = time.monotonic() + self.reconnect_s, 0
        while True:
            try:
                self.registration = Registration(self.address, self.heartbeat_s, self.timeout_s,
                                                 connect_s=max(1.0, min(10.0, self.reconnect_s)), token=self.token)
                break
            except (SessionLost, RuntimeError) as err:
                wait = backoff(attempt)
                if time.monotonic() + wait > deadline:
                    raise RuntimeError(f"No outer service reachable at {self.address} within reconnect_s="
                                       f"{self.reconnect_s}s: {err} Start (or restart) the service, or raise"
                                       " `reconnect_s` to wait longer.") from err
                log.warning("outer service at %s unreachable (%s); retrying in %.1fs", self.address, err, wait)
                time.sleep(wait)
                attempt += 1
        log.info("session %d opened with %s", self.registration.session, self.address)
        return self.registration.session, self.registration.config

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
