"""Rank 0's exchange service: the outer optimizer answering the workers, on two background threads.

The *receiver* thread takes remote workers' messages from a :class:`~.transport.ServerTransport` into the inbox
(rank 0's own worker puts its pushes there directly, through :class:`~.transport.InProcessTransport`). The
*server* thread takes batches from the inbox, applies them to the :class:`~.outer.OuterState` and replies to
every worker that waits. Batches follow the step policy: ``batch_window`` seconds after the first push (closing
early once every worker still training is in the batch), or until every worker still training has pushed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from lightning_hdet.asynchronous.messages import Kind, Push, ServerHeader
from lightning_hdet.asynchronous.outer import OuterState
from lightning_hdet.asynchronous.transport import InProcessTransport, ServerTransport

log = logging.getLogger(__name__)


class Server:
    """The outer optimizer's service for ``workers`` workers: worker 0 in this process, the others remote.

    Args:
        outer: the outer state it applies pushes to.
        workers: how many workers exchange (worker 0 included).
        remote: the transport to workers ``1..workers-1`` (``None`` only when ``workers == 1``).
        timeout: seconds any wait may take before the server fails.
    """

    def __init__(self, outer: OuterState, workers: int, remote: ServerTransport | None, timeout: float) -> None:
        self.outer, self.workers, self.remote, self.timeout = outer, workers, remote, timeout
        self.inbox: queue.Queue[Push] = queue.Queue()
        n_params = outer.params.numel()
        #: Rank 0's own worker's transport.
        self.local = InProcessTransport(self.inbox, n_params, timeout, self.raise_error)
        self.error: BaseException | None = None
        targets: list[tuple[Callable[[], None], str]] = [(self._serve, "async-local-sgd-server")]
        if workers > 1:
            targets.insert(0, (self._receive, "async-local-sgd-receiver"))
        self._threads = [threading.Thread(target=self._guard, args=(target,), name=name, daemon=True)
                         for target, name in targets]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        """Wait for both threads (every worker has left), then raise if the server failed."""
        for t in self._threads:
            t.join(self.timeout)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("The asynchronous Local-SGD server on rank 0 failed.") from self.error

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:  # reported to the training thread
            self.error = err
            self.local.wake()

    def _receive(self) -> None:
        assert self.remote is not None
        remaining = self.workers - 1
        while remaining:
            push = self.remote.receive()
            remaining -= push.kind == Kind.BYE
            self.inbox.put(push)

    def _serve(self) -> None:
        active = set(range(self.workers))
        while active:
            batch = self._collect(len(active))
            replies = self.outer.process(batch)
            active -= {p.worker for p in batch if p.kind == Kind.BYE}
            log.debug("applied %d push(es); %d worker(s) still training", len(batch), len(active))
            params, buffers = self.outer.params.detach(), self.outer.buffers
            for worker, steps in replies.items():
                header = ServerHeader(steps, self.outer.outer_updates)
                if worker == self.local.worker:
                    self.local.reply(header, params, buffers)
                else:
                    assert self.remote is not None
                    self.remote.reply(worker, header, params, buffers)

    def _collect(self, active: int) -> list[Push]:
        """One batch: the first push, then those within the policy's window (a window closes early once every
        active worker is in the batch: each waits for its reply, so no further push can come)."""
        batch = [self.inbox.get(timeout=self.timeout)]
        window = self.outer.step_policy.batch_window
        deadline = None if window is None else time.monotonic() + window
        while len(batch) < active:
            left = self.timeout if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.inbox.get(timeout=left))
            except queue.Empty:
                if deadline is None:
                    raise
                break
        return batch
