"""Session bookkeeping and lease expiry for workers that come and go. Pure: no process groups, no Lightning.

A *session* is one worker process's stay with the outer service, from registration to leaving. Session ids are
handed out once and never reused (a restarted server continues after the largest id of its checkpoint), so a
late message from an ended session can never be mistaken for a live one.

Rules (``docs/elastic.md`` states them for users):

* **Lease.** Every session holds a lease of ``lease_s`` seconds, renewed whenever its heartbeat counter changes
  (the worker increments it every ``heartbeat_s``; the server reads it on its own monotonic clock, so no clocks
  are compared across machines). A session whose counter has not changed for ``lease_s`` has expired.
* **Buffer size.** Delayed Nesterov's ``N`` follows the live set: ``min(buffer_size or live, live)``, at least 1,
  changed only at a momentum-update boundary (no pushes buffered), so that a buffer is never cut short.
* **Parking.** A worker whose next round would get 0 steps while budget is left *and* another live worker still
  holds steps in flight is not told to stop: its reply waits until those steps are pushed (the budget is met) or
  their session ends (its share is released and handed out again).
* **Data.** Session ``s`` seeds its data order with ``seed + s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_hdet._checks import check_int, check_number, require


@dataclass
class Session:
    """One live session as the server sees it."""

    id: int
    #: Server-clock time the lease was last renewed.
    renewed: float
    #: The heartbeat counter last read (``-1``: none read yet).
    beats: int = -1


@dataclass
class SessionTable:
    """The live sessions and the next id to hand out.

    Args:
        lease_s: seconds without a heartbeat after which a session has expired.
        next_id: the first id to hand out (a restarted server passes its checkpoint's).
    """

    lease_s: float
    next_id: int = 1
    live: dict[int, Session] = field(default_factory=dict)
    #: Why each ended session ended (``"left"``, ``"lost: ..."``, ``"expired"``).
    ended: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_number("lease_s", self.lease_s, low=0, low_open=True, hint="It is in seconds.")
        check_int("next_id", self.next_id, minimum=1)

    def open(self, session: int, now: float) -> Session:
        """Start ``session`` (an id handed out by the store's counter) with a fresh lease."""
        if session in self.live or session in self.ended:
            raise ValueError(f"Session {session} was opened before; ids are never reused.")
        self.next_id = max(self.next_id, session + 1)
        self.live[session] = Session(session, now)
        return self.live[session]

    def beat(self, session: int, beats: int, now: float) -> None:
        """Record the heartbeat counter read for ``session``; a changed counter renews its lease."""
        entry = self.live.get(session)
        if entry is not None and beats != entry.beats:
            entry.beats, entry.renewed = beats, now

    def expired(self, now: float) -> list[int]:
        """Live sessions whose lease ran out (``now - renewed >= lease_s``), in id order."""
        return sorted(s for s, e in self.live.items() if now - e.renewed >= self.lease_s)

    def end(self, session: int, reason: str) -> bool:
        """End ``session``; False when it was not live (ended before, or never opened)."""
        if self.live.pop(session, None) is None:
            return False
        self.ended[session] = reason
        return True

    def refuse(self, session: int, reason: str) -> None:
        """``session`` registered but was never opened (e.g. a wrong token): its id is used up."""
        self.next_id = max(self.next_id, session + 1)
        self.ended[session] = reason

    def is_live(self, session: int) -> bool:
        return session in self.live


def check_token(token: object) -> None:
    """The shared secret of :class:`~.service.OuterService` / :class:`~.strategy.ElasticWorkerStrategy`."""
    require("token", "<hidden>" if isinstance(token, str) else token, token is None or (isinstance(token, str) and token),
            "None or a non-empty string", "Set the same token on the service and on every worker.")


def should_park(allocated: int, budget_left: int | None, others_in_flight: int) -> bool:
    """Hold a worker's reply instead of telling it to stop: its allocation is 0, but budget is left and other
    workers' in-flight steps may yet be released (if their sessions end)."""
    return allocated <= 0 and budget_left is not None and budget_left > 0 and others_in_flight > 0


def session_seed(seed: int, session: int) -> int:
    """The data seed of ``session``: each session draws its own order (``seed + session``)."""
    return seed + session


def backoff(attempt: int, first: float = 0.5, cap: float = 5.0) -> float:
    """Seconds to wait before reconnect attempt ``attempt`` (0, 1, ...): ``min(cap, first * 2**attempt)``."""
    return min(cap, first * 2.0**attempt)
