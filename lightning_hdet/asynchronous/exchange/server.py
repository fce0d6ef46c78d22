"""Rank 0's exchange service on two threads: the *receiver* applies remote pushes fragment by fragment as they
arrive (rank 0's own worker does so from its training thread); the *server* closes batches by the step policy and
replies. Every worker of a batch restarts from one version: until a batch's replies are sent, a new push waits
before it is applied (the *reply gate*), else a fast worker's next round could be applied before a slow one's reply.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_hdet.asynchronous.exchange.public_model import PublicModel
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader
from lightning_hdet.asynchronous.wire.transport import InProcessTransport, ServerTransport

log = logging.getLogger(__name__)

#: Put into the inbox by :meth:`Server.stop`: the server thread ends on taking it.
_STOP: Push = object()  # type: ignore[assignment]


class Server:
    """The outer optimizer's service: worker 0 in this process, the others over ``remote``."""

    def __init__(self, outer: OuterState, workers: int, remote: ServerTransport | None, timeout: float,
                 layout: Fragments | None = None) -> None:
        self.outer, self.workers, self.remote, self.timeout = outer, workers, remote, timeout
        self.layout = layout or Fragments([torch.Size([e - s]) for s, e in outer.ranges])
        if self.layout.ranges != outer.ranges:
            raise ValueError(f"The pushes' fragments {self.layout.ranges} are not the outer state's {outer.ranges}.")
        self.inbox: queue.Queue[Push] = queue.Queue()
        self._decoded = torch.empty(self.layout.largest, dtype=torch.float32)  # rank 0's own worker's
        self._decoded_remote = torch.empty(self.layout.largest if workers > 1 else 0, dtype=torch.float32)
        self._reply = self.layout.pull_buffer()  # used under the outer state's model lock only
        self.public = PublicModel(outer.params, self.layout) if self.layout.delta_codecs else None
        # where the step policy keeps the round's pushes as encoded (SparseLoCo's; None: it keeps none)
        self.round: Any = outer.step_policy.keeps_messages(self.layout.codecs, workers)
        # the public model's changes are the rounds themselves (sparse pulls) or its own encoding of G - P
        self._forwards = bool(self.layout.round_codecs)
        if self._forwards and self.round is None:
            raise ValueError("Pulls that forward the rounds' pushes follow SparseLoCo only.")
        self.local = InProcessTransport(self.accept, self.read_model, timeout, self.raise_error,
                                        gradient_bytes=self.layout.part_nbytes)
        self.error: BaseException | None = None
        self._gate = threading.Condition()
        self._replies_pending = 0  # > 0: a batch's replies are being sent; pushes wait before being applied
        targets: list[tuple[Callable[[], None], str]] = [(self._serve, "async-local-sgd-server")]
        if workers > 1:
            targets.insert(0, (self._receive, "async-local-sgd-receiver"))
        self._threads = [threading.Thread(target=self._guard, args=(target,), name=name, daemon=True)
                         for target, name in targets]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join(self.timeout)
        self.raise_error()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def stop(self, timeout: float) -> None:
        """End both threads early (the fit failed); a receiver blocked in its transport waits for it to fail."""
        if self.error is None:
            self.error = RuntimeError("the server was stopped")
        self.inbox.put(_STOP)
        with self._gate:
            self._gate.notify_all()
        for t in self._threads:
            t.join(timeout)

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("The asynchronous Local-SGD server on rank 0 failed.") from self.error

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:  # reported to the training thread
            self.error = err
            self.local.wake()
            with self._gate:  # a push waiting at the gate fails now, not after its timeout
                self._gate.notify_all()

    def accept(self, push: Push, messages: Iterable[Tensor]) -> None:
        """Apply a push fragment by fragment as its ``messages`` arrive, then queue it for its batch."""
        out = self._decoded if push.worker == self.local.worker else self._decoded_remote
        with self._gate:
            self._wait_for_replies(f"A push from worker {push.worker}")
        self.raise_error()
        if self.round is not None:
            messages = self.round.keeping(push.worker, messages)
        # the stream is read only now: a remote sender waits meanwhile (no copy is queued)
        self.outer.receive(push, self.layout.decode(messages, out, push.part))
        if self.round is not None and push.rejected is not None:
            self.round.drop(push.worker)
        self.inbox.put(push)

    def read_model(self, worker: int, into: Tensor, combine: Callable[[int, Tensor], None] | None = None,
                   part: int = -1) -> int:
        """Rank 0's own pull into ``into`` (or piece by piece to ``combine``); returns the version."""
        n = self.layout.numel
        with self.outer.model_lock:
            # the public model itself with a delta codec: rank 0's worker trains from what the others hold
            params = self.outer.params.detach() if self.public is None else self.public.params
            if combine is None:
                self.layout.pull_into(params, into[:n], self._reply, part)
                into[n:].copy_(self.outer.buffers)
            else:  # the decode buffer of rank 0's own pushes: this runs in the same (training) thread
                for start, values in self.layout.pull_values(params, self._reply, self._decoded, part):
                    combine(start, values)
                combine(n, self.outer.buffers)
            version = self.outer.mark_pulled(worker)
        self._replied()
        return version

    def _wait_for_replies(self, who: str) -> None:
        """Wait (holding :attr:`_gate`) until the last batch's replies are done, or the server failed."""
        if not self._gate.wait_for(lambda: self._replies_pending == 0 or self.error is not None, self.timeout):
            raise TimeoutError(f"{who} waited over {self.timeout} s for the previous batch's replies.")

    def _replied(self) -> None:
        with self._gate:
            self._replies_pending -= 1
            self._gate.notify_all()

    def _receive(self) -> None:
        assert self.remote is not None
        remaining = self.workers - 1
        while remaining:
            push, messages = self.remote.receive()
            remaining -= push.kind == Kind.BYE
            self.accept(push, messages)

    def _serve(self) -> None:
        active, stopping = set(range(self.workers)), set()
        while active:
            batch = self._collect(len(active))
            with self._gate:  # closed before close(): no push may enter the version this batch is sent
                # rank 0's pull of the last batch may still be pending (async: the inbox can already hold pushes)
                self._wait_for_replies("The next batch")
                self._replies_pending = 1  # this loop
            replies = self.outer.close(batch)
            parts = {p.worker: p.part for p in batch}  # a reply carries the fragments its push carried
            left = {p.worker for p in batch if p.kind == Kind.BYE}
            active -= left
            if self.public is not None:
                with self.outer.model_lock:  # every reply of the batch sends one version
                    change = self.round.change if self.round is not None and self._forwards else None
                    self.public.publish(self.outer.params.detach(), self.outer.outer_updates, change)
                    for worker in left:
                        self.public.forget(worker)
            stopping |= {w for w, steps in replies.items() if steps <= 0}  # they leave next (BYE)
            self.outer.follow_live(len(active - stopping))
            log.debug("closed a batch of %d push(es); %d worker(s) still training", len(batch), len(active))
            if replies.get(self.local.worker, 0) > 0:
                with self._gate:  # and rank 0's own pull
                    self._replies_pending += 1
            for worker, steps in replies.items():
                rejected = self.outer.rejection_streak(worker)
                if worker == self.local.worker:
                    # its pull copies the model, and the version then, unless it stops
                    self.local.reply(ServerHeader(steps, self.outer.outer_updates, rejected, part=parts[worker],
                                                  checkpoints=self.outer.counts.requests))
                    continue
                with self.outer.model_lock:  # one version, fragment by fragment, with no copy
                    self._reply_to(worker, steps, rejected, parts[worker])
            self._replied()

    def _reply_to(self, worker: int, steps: int, rejected: int, part: int) -> None:
        """Send a remote worker its reply (under the model lock): the parameters or the changes it lacks."""
        assert self.remote is not None
        deltas, params = -1, iter(())
        if steps > 0 and self.public is not None:
            deltas, messages = self.public.reply(worker)
            if self.layout.skips_own(deltas, rejected):  # it has its own push: 1/W of the change less to send
                messages = self.layout.without_own(messages, worker)
            params = iter(messages)
        elif steps > 0:
            params = self.layout.encode_pull(self.outer.params.detach(), self._reply, part)
        nbytes = self.layout.reply_nbytes(deltas, part, rejected) + 4 * self.outer.buffers.numel() if steps > 0 else 0
        version = self.outer.mark_pulled(worker, nbytes, dense=steps > 0 and deltas < 0)
        header = ServerHeader(steps, version, rejected, deltas, part, self.outer.counts.requests)
        self.remote.reply(worker, header, params, self.outer.buffers)

    def _next(self, timeout: float) -> Push:
        push = self.inbox.get(timeout=timeout)
        if push is _STOP:
            raise RuntimeError("the server was stopped")
        return push

    def _collect(self, active: int) -> list[Push]:
        """One batch: the first push, then those within the policy's window (or until all are in)."""
        batch = [self._next(self.timeout)]
        window = self.outer.step_policy.batch_window
        deadline = None if window is None else time.monotonic() + window
        while len(batch) < active:
            left = self.timeout if deadline is None else deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self._next(left))
            except queue.Empty:
                if deadline is None:
                    raise
                break
        return batch
