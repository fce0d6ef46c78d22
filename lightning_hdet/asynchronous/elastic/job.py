"""An elastic worker of several ranks: one *job* (e.g. a node's k devices, DDP inside) that is ONE session.

The job's rank 0 alone meets the service: it opens the session, heartbeats, pushes and pulls. Everything the other
ranks must know to stay in step with it travels over the job's own collectives (a :class:`JobComm`):

* the session it opened (id and the service's config), or why it could not (:func:`share_session`): every rank
  seeds its data with the same session and checks the same model sizes;
* each reply and the global model (:class:`JobLeaderTransport`, :class:`JobFollowerTransport`, built on the
  single-job mode's leader / follower transports of :mod:`..ranks`): every rank runs the same round bookkeeping
  (round length, rejections, stop) from the same replies, so the job's ranks keep identical parameters and stop
  at the same step;
* a lost session: the follower's pull then raises :class:`~.membership.SessionLost` too, and every rank reopens
  (rank 0 registers again, the others receive the new session).

A job of one rank (:class:`SoloJob`) uses none of this: its transport is the session's own, as before. Pure: the
collectives are injected (no Lightning, no process groups here).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_hdet.asynchronous.elastic.membership import SessionLost
from lightning_hdet.asynchronous.exchange.ranks import FollowerTransport, LeaderTransport
from lightning_hdet.asynchronous.wire.messages import Kind, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport

#: What rank 0 broadcasts instead of a reply when its session was lost (job-internal: never sent to the service).
LOST = ServerHeader(-1, 0, 0)
#: Errors opening a session that every rank raises as the same type (anything else: a ``RuntimeError``).
_ERRORS: dict[str, type[Exception]] = {"PermissionError": PermissionError, "ValueError": ValueError}


class JobComm(Protocol):
    """The collectives of one worker job over its own ranks (host tensors, in place)."""

    #: This process's rank in the job (0: the one that meets the service).
    rank: int
    #: The job's ranks.
    size: int

    def broadcast(self, tensor: Tensor) -> None:
        """Overwrite ``tensor`` on every rank with rank 0's."""

    def max_reduce(self, tensor: Tensor) -> None:
        """Overwrite ``tensor`` on every rank with the element-wise maximum over the ranks."""


class SoloJob:
    """A job of one rank: nothing to share."""

    rank, size = 0, 1

    def broadcast(self, tensor: Tensor) -> None:
        pass

    def max_reduce(self, tensor: Tensor) -> None:
        pass


def broadcast_json(job: JobComm, value: Any = None) -> Any:
    """Rank 0's ``value`` (JSON-serializable) on every rank: its length, then its bytes."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if job.rank == 0 else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
    job.broadcast(size)
    if data is None:
        data = torch.empty(int(size[0]), dtype=torch.uint8)
    job.broadcast(data)
    return json.loads(bytes(data.tolist()).decode())


def share_session(job: JobComm, open_session: Callable[[], tuple[int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """The session rank 0 opens with ``open_session`` (its id and the service's config), on every rank of the job.
    Where rank 0 fails (service unreachable within ``reconnect_s``, refused token), every rank raises, so that no
    rank waits for a session that never comes."""
    if job.size == 1:
        return open_session()
    if job.rank != 0:
        message = broadcast_json(job)
        if "error" in message:
            raise _ERRORS.get(message["error"], RuntimeError)(
                f"rank 0 of this worker job could not open a session: {message['message']}")
        return int(message["session"]), dict(message["config"])
    try:
        session, config = open_session()
    except Exception as err:  # any failure: the other ranks must hear of it before rank 0 leaves
        broadcast_json(job, {"error": type(err).__name__, "message": str(err)})
        raise
    broadcast_json(job, {"session": session, "config": config})
    return session, config


class JobLeaderTransport(LeaderTransport):
    """Rank 0's end: pushes and pulls over its session and hands every reply (and the global model) on to the job's
    other ranks; a lost session is handed on as :data:`LOST` (unless leaving: the others then pull nothing)."""

    def __init__(self, session: WorkerTransport, job: JobComm) -> None:
        super().__init__(session, job.broadcast, job.max_reduce)

    def push(self, header: WorkerHeader, messages: Iterable[Tensor], buffers: Tensor | None,
             inner_state: Tensor | None) -> None:
        try:
            super().push(header, messages, buffers, inner_state)
        except SessionLost:
            if header.kind != Kind.BYE:  # the followers wait for this round's reply
                self.broadcast(LOST.encode())
            raise

    def pull(self, into: Tensor) -> ServerHeader:
        try:
            header = self.inner.pull(into)
        except SessionLost:
            self.broadcast(LOST.encode())
            raise
        self.broadcast(header.encode())
        if header.next_local_steps > 0:
            self.broadcast(into)
        return header


class JobFollowerTransport(FollowerTransport):
    """Another rank's end: reports its compute time (the round's is the job's slowest rank's) and receives rank 0's
    reply and global model; rank 0's lost session is lost here too."""

    def __init__(self, job: JobComm) -> None:
        super().__init__(job.broadcast, job.max_reduce)
        self.job_rank = job.rank

    def pull(self, into: Tensor) -> ServerHeader:
        header = super().pull(into)
        if header == LOST:
            raise SessionLost(f"rank {self.job_rank} of this worker job: rank 0 lost the session")
        return header


def job_transport(job: JobComm, session: WorkerTransport | None) -> WorkerTransport:
    """This rank's transport: the session's own in a job of one rank (exactly as a one-process worker), else rank
    0's session behind a :class:`JobLeaderTransport`, or a :class:`JobFollowerTransport` (``session``: ``None``)."""
    if job.rank != 0:
        return JobFollowerTransport(job)
    assert session is not None
    return session if job.size == 1 else JobLeaderTransport(session, job)
