"""Registration, heartbeats and per-session process groups, on torch's own machinery.

The server hosts a :class:`torch.distributed.TCPStore` at the address the user gives (a socket bound to exactly that
host and port is handed to the store). A worker registers by incrementing the store's session counter (the value it gets
back is its session id), beats by incrementing its own counter every ``heartbeat_s``, and meets the server in a fresh
two-rank ``ProcessGroupGloo`` under the store prefix of its session (server rank 0, worker rank 1), each side bound to
its own address. Nothing here decides anything: :mod:`.sessions` keeps the books. Trusted networks only: the store and
gloo neither authenticate nor encrypt. A shared ``token`` (optional) only keeps a stray process from joining by mistake:
a worker proves it knows the token by writing ``HMAC-SHA256(token, session id)`` under its session (the token itself
never travels), and waits for the service's verdict before it meets it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_hdet._checks import require
from lightning_hdet._compat import gloo_options

log = logging.getLogger(__name__)

_COUNTER, _CONFIG = "elastic/next_session", "elastic/config"


class SessionLost(RuntimeError):
    """A session's process group or store failed (the peer died, hung past the timeout, or left)."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``."""
    host, sep, port = str(address).rpartition(":")
    ok = bool(sep and host and port.isdigit() and 0 <= int(port) < 65536)
    require("server", address, ok, "'host:port' (e.g. '10.0.0.5:29400')",
            "Give the address the outer service binds to and the workers reach.")
    return host.strip("[]"), int(port)


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent: a UDP socket only picks a route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port or 1))
        return probe.getsockname()[0]


def session_group(store: dist.Store, session: int, rank: int, host: str, timeout: float) -> Any:
    """The session's two-rank gloo group (rank 0: server, rank 1: worker), on a device bound to ``host``."""
    options = gloo_options(timedelta(seconds=timeout), host)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"elastic/session/{session}/", store), rank, 2, options)


def session_key(kind: str, session: int) -> str:
    """``session``'s store key of a ``kind``: ``"beat"`` (its heartbeat counter), ``"auth"`` (its token's proof),
    ``"verdict"`` (the service's answer), ``"meet"``: set by a worker just before it meets the service in the session's
    group; until then the service's side waits in short checks it can give up (a worker frozen between registering and
    meeting must not hold a thread inside gloo's rendezvous, which only ends after ``timeout_s``)."""
    return f"elastic/{kind}/{session}"


def token_proof(token: str, session: int) -> str:
    """What a worker with ``token`` writes for ``session``: an HMAC of the session id (useless for another one)."""
    return hmac.new(token.encode(), f"lightning_hdet.elastic/{session}".encode(), hashlib.sha256).hexdigest()


def proof_matches(token: str, session: int, proof: str) -> bool:
    return hmac.compare_digest(token_proof(token, session), proof)


class StoreHost:
    """The server's store: bound to the given address, holding the run's config and the session counter.

    Args:
        address: ``"host:port"`` to bind (port 0: any free port, see :attr:`port`).
        config: what every worker must agree on (sizes, codec), read by workers when they register.
        next_id: the first session id to hand out.
    """

    def __init__(self, address: str, config: dict[str, Any], next_id: int, timeout: float) -> None:
        self.host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server rebinds at once
        self._socket.bind((self.host, port))  # exactly the address given, not every interface
        self._socket.listen(128)
        self.port = self._socket.getsockname()[1]
        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout), master_listen_fd=self._socket.fileno())
        self.store.set(_CONFIG, json.dumps(config))
        self.store.add(_COUNTER, next_id - 1)  # the next registration gets next_id

    def client(self, timeout: float) -> dist.TCPStore:
        """A connection of its own to this store. Why: a store object serializes its calls, so one session's group
        rendezvous (a blocking wait for a worker that may be frozen) on the shared connection would stall the
        service's heartbeat reads, and with them every lease."""
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout))

    def proof(self, session: int) -> str | None:
        """What ``session``'s worker wrote to prove it knows the token (``None``: nothing yet; never blocks)."""
        key = session_key("auth", session)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def decide(self, session: int, admitted: bool) -> None:
        """Tell ``session``'s worker whether it may meet the service."""
        self.store.set(session_key("verdict", session), "admitted" if admitted else "refused")

    def registered(self) -> int:
        """The largest session id handed out so far."""
        return self.store.add(_COUNTER, 0)

    def beats(self, session: int) -> int:
        return self.store.add(session_key("beat", session), 0)


class Registration:
    """A worker's side of one session: its store client, id, heartbeat thread and process group.

    Args:
        address: the server's ``"host:port"``.
        heartbeat_s: seconds between heartbeats.
        timeout: seconds any message of the session may take (longer than any round).
        connect_s: seconds to wait for the store when registering.
        token: the shared secret, when the service requires one (raises :class:`PermissionError` when refused).
    """

    def __init__(self, address: str, heartbeat_s: float, timeout: float, connect_s: float,
                 token: str | None = None) -> None:
        host, port = parse_address(address)
        try:
            self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_s))
            self._beat_store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=connect_s))
            self.config: dict[str, Any] = json.loads(self.store.get(_CONFIG))
            if self.config.get("token") and token is None:
                raise PermissionError(f"The outer service at {address} requires a `token`; give ElasticWorkerStrategy"
                                      "(token=...) the one the OuterService was started with.")
            self.session = int(self.store.add(_COUNTER, 1))
            if self.config.get("token"):
                self.store.set(session_key("auth", self.session), token_proof(token, self.session))
                self.store.wait([session_key("verdict", self.session)], timedelta(seconds=timeout))
                if self.store.get(session_key("verdict", self.session)).decode() != "admitted":
                    raise PermissionError(f"The outer service at {address} refused this worker: its `token` does not"
                                          " match the service's. Give ElasticWorkerStrategy(token=...) the token the"
                                          " OuterService was started with.")
        except (RuntimeError, ValueError) as err:  # DistNetworkError / DistStoreError derive from RuntimeError
            raise SessionLost(f"cannot register with the outer service at {address}: {first_line(err)}") from err
        self.alive = True
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                           name=f"elastic-heartbeat-{self.session}")
        self._heartbeat.start()
        try:
            self.store.set(session_key("meet", self.session), "1")
            self.group = session_group(self.store, self.session, 1, local_address_towards(host, port), timeout)
        except RuntimeError as err:  # the server went away between registering and meeting
            self._stop.set()
            raise SessionLost(f"session {self.session}: cannot meet the outer service: {first_line(err)}") from err

    def _beat(self, every: float) -> None:
        while not self._stop.is_set():
            try:
                self._beat_store.add(session_key("beat", self.session), 1)
            except RuntimeError:  # the server is gone: the next exchange finds out and reconnects
                self.alive = False
                # and an exchange already waiting on the group returns now: a gloo wait on a killed peer can outlast
                # the session (a CI run: a worker with reconnect_s=0 still waiting 300 s after its server was killed)
                group = getattr(self, "group", None)
                if group is not None:
                    abort(group)
                return
            self._stop.wait(every)

    def close(self) -> None:
        """Stop beating (the server's lease for this session then runs out if it did not see us leave)."""
        self._stop.set()
        self._heartbeat.join(timeout=5)
        abort(self.group)


def first_line(err: BaseException) -> str:
    """torch's network errors carry a C++ stack trace after the first line."""
    return (str(err).splitlines() or [""])[0][:300]


def abort(group: Any) -> None:
    """Tear a session's group down so that a thread blocked on it returns (best effort: the peer may be gone)."""
    try:
        group.abort()
    except RuntimeError as err:  # already broken: nothing left to tear down
        log.debug("abort: %s", err)
