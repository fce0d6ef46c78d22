"""The outer optimizer as its own service, for workers that come and go (``docs/elastic.md``).

:class:`OuterService` owns the global model, the outer state (:class:`~..outer.OuterState`: async Delayed
Nesterov, the sample budget, per-worker statistics), the session table (:mod:`.sessions`), validation and its own
checkpoints. Workers are separate Lightning jobs (:class:`~.strategy.ElasticWorkerStrategy`) that register a
session, pull the newest global model and run the usual rounds; one loop here applies their pushes in order, so
every decision (batches, round lengths, leaving, parking) is taken in one place.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from lightning_hdet._checks import check_int, check_names, check_number, own_arguments, require
from lightning_hdet._tensors import float_buffers, write_from
from lightning_hdet.asynchronous.elastic.hub import Lost, SessionHub
from lightning_hdet.asynchronous.elastic.membership import SessionLost, proof_matches
from lightning_hdet.asynchronous.elastic.sessions import SessionTable, check_token, should_park
from lightning_hdet.asynchronous.exchange.exchange import read_model
from lightning_hdet.asynchronous.lightning.readouts import outer_result
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.result import AsyncResult
from lightning_hdet.asynchronous.outer.momentum import refuse_moved
from lightning_hdet.asynchronous.wire.codecs import Codec, check_codecs, codec_from
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader

log = logging.getLogger(__name__)
FORMAT = "lightning_hdet.elastic/1"
Evaluate = Callable[[Module], Mapping[str, float]]


def elastic_settings(compression: Any, pull_compression: Any, outer: Mapping[str, Any]) -> tuple[OuterSettings, Codec,
                                                                                                  Codec]:
    """The service's outer settings and codec objects from its arguments, refusing what an elastic service cannot
    do (DiLoCo, retired here: torchft runs it, docs/elastic.md says why)."""
    mode = outer.get("mode", "async")
    require("mode", mode, mode == "async", "'async' with an elastic service", "DiLoCo across jobs runs on torchft:"
            " each job TorchFTStrategy(TorchFT(lighthouse='http://HOST:29510', min_replicas=2), local_steps=H)"
            " (docs/elastic.md, 'DiLoCo on torchft').")
    settings = OuterSettings(**outer)
    push, pull = codec_from(compression), codec_from(pull_compression, "pull_compression")
    settings.outer.check_codecs(push, pull)
    check_codecs(push, pull, None)
    require("pull_compression", pull, not pull.sends_changes, "NoCodec() or BF16() ('none', 'bf16') with an elastic"
            " service", "A change of the public model needs the version a worker holds; a session that rejoins after"
            " a restart of the service holds none the service knows. Use AsyncLocalSGDStrategy for delta pulls.")
    settings.outer.check_elastic()
    return settings, push, pull


class OuterService:
    """The outer optimizer's service at ``address``; :meth:`run` serves until the budget is spent and every
    session has left.

    Args:
        module: the model; its parameters and floating-point buffers are the global model's start (or the
            checkpoint's), and it holds the global model after :meth:`run`.
        address: ``"host:port"`` to bind (trusted networks only: nothing is encrypted, see ``token``).
        budget: inner steps summed over all workers and sessions (``None``: until :meth:`request_stop`).
        checkpoint: file the service checkpoints itself to, and resumes from when it exists.
        checkpoint_every: outer updates between checkpoints (also one at the end).
        lease_s: seconds without a heartbeat after which a session ends.
        heartbeat_s: seconds between the service's membership checks (workers beat at their own interval).
        timeout_s: seconds any message may take; longer than the longest round (a parked worker waits too).
        compression: the pseudo-gradients' codec (the workers read it from the service).
        pull_compression: the pulled global parameters' codec, ``"none"`` or ``"bf16"`` (read by the workers too).
        evaluate: called with the global model in ``module`` every ``evaluate_every`` outer updates and at the
            end; its metrics are kept in :attr:`evaluations`, the checkpoint and the status file.
        max_idle_s: end when no session was live for this long (``None``: wait for workers indefinitely).
        token: a shared secret every worker must give (``ElasticWorkerStrategy(token=...)``) to open a session;
            ``None`` (default): any process that reaches the address may join. It keeps stray processes out; it is
            not encryption (the model and the pushes still travel in the clear).
        **outer: :class:`~..outer.state.OuterSettings` (``mode="async"``, ``local_steps``, ``outer=DelayedNesterov(...)``,
            ``check_pushes``, ...), as the strategy takes them.
    """

    def __init__(self, module: Module, address: str, budget: int | None, checkpoint: str | Path | None = None,
                 checkpoint_every: int = 10, lease_s: float = 10.0, heartbeat_s: float = 0.5,
                 timeout_s: float = 1800.0, compression: Codec | str = "none", evaluate: Evaluate | None = None,
                 evaluate_every: int = 0, max_idle_s: float | None = None, pull_compression: Codec | str = "none",
                 token: str | None = None, **outer: Any) -> None:
        refuse_moved(type(self).__name__, outer)
        check_names(type(self).__name__, outer, own_arguments(type(self)),
                    {"OuterSettings": [f.name for f in fields(OuterSettings)]})
        check_token(token)
        check_int("budget", budget, minimum=1, optional=True)
        check_int("checkpoint_every", checkpoint_every, minimum=1)
        check_int("evaluate_every", evaluate_every, minimum=0)
        for name, value in (("heartbeat_s", heartbeat_s), ("timeout_s", timeout_s)):
            check_number(name, value, low=0, low_open=True, hint="It is in seconds.")
        check_number("max_idle_s", max_idle_s, low=0, optional=True)
        self.settings, compression, pull_compression = elastic_settings(compression, pull_compression, outer)
        self.module, self.address, self.budget = module, address, budget
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.checkpoint_every, self.evaluate, self.evaluate_every = checkpoint_every, evaluate, evaluate_every
        self.heartbeat_s, self.timeout_s, self.max_idle_s = heartbeat_s, timeout_s, max_idle_s
        self.compression, self.pull_compression, self.token = compression, pull_compression, token
        self._pending: dict[int, float] = {}  # registered sessions waiting for their token's proof, since when
        self.outer = self.settings.build(*read_model(module, torch.device("cpu")), 1, budget)
        self.table = SessionTable(lease_s)
        #: ``(outer_updates, metrics)`` of every evaluation.
        self.evaluations: list[tuple[int, dict[str, float]]] = []
        self._parked: dict[int, Push] = {}
        self._marks = {"checkpoint": 0, "evaluate": 0}
        self.hub: SessionHub | None = None
        self._first_session: float | None = None
        if self.checkpoint is not None and self.checkpoint.exists():
            self._resume(torch.load(self.checkpoint, weights_only=True))

    # life cycle
    @functools.cached_property
    def _layout(self) -> Fragments:
        """The fragments and codecs of the sessions' pushes and pulls."""
        return Fragments([p.shape for p in self.module.parameters()], self.compression,
                         pull_compression=self.pull_compression)

    def start(self) -> None:
        """Bind the address and open registration."""
        n_buffers, layout = self.outer.buffers.numel(), self._layout
        config = {"n_params": self.outer.params.numel(), "n_buffers": n_buffers,
                  "compression": self.compression.options(), "pull_compression": self.pull_compression.options(),
                  "mode": self.settings.mode, "token": self.token is not None}
        self.hub = SessionHub(self.address, config, self.table.next_id, self.timeout_s, n_buffers, layout)
        self._next_tick = 0.0
        self._idle_since = time.monotonic()
        self._scanned = self.table.next_id - 1  # the largest registered session id looked at
        log.info("outer service at %s:%d (sessions from %d)", self.hub.host.host, self.hub.port, self.table.next_id)

    def run(self) -> None:
        """Serve until the budget is spent (or a stop was requested) and every session has left; then evaluate,
        checkpoint, and leave the global model in ``module``."""
        if self.hub is None:
            self.start()
        try:
            while not self._finished():
                push = self._next(self.heartbeat_s)
                if push is not None:
                    self._apply(self._collect(push))
        finally:
            self._write_global_model()
            if self.evaluate is not None:
                self._evaluate()
            self.save()
            self.hub.close()
        log.info("outer service done\n%s", self.result.summary())

    def request_stop(self) -> None:
        """Every worker's next reply says stop (e.g. from ``evaluate``, for early stopping)."""
        self.outer.request_stop()

    def _finished(self) -> bool:
        if self.table.live:
            return False
        spent = self.budget is not None and self.outer.steps_done >= self.budget
        idle = self.max_idle_s is not None and time.monotonic() - self._idle_since >= self.max_idle_s
        return spent or self.outer.stop_requested or idle

    # membership
    def _next(self, timeout: float) -> Push | None:
        """The next push of a live session, or None after ``timeout`` or a loss (its session ends; an ended session's
        push is discarded); checks membership every ``heartbeat_s``."""
        assert self.hub is not None
        now = time.monotonic()
        if now >= self._next_tick:
            self._tick(now)
            self._next_tick = now + self.heartbeat_s
        try:
            item = self.hub.inbox.get(timeout=max(0.0, min(timeout, self._next_tick - now)))
        except queue.Empty:
            return None
        if isinstance(item, Lost):
            self._end(item.session, f"lost: {item.reason}")
        return item if isinstance(item, Push) and self.table.is_live(item.worker) else None

    def _tick(self, now: float) -> None:
        """Open newly registered sessions, read heartbeats, end the sessions whose lease ran out."""
        assert self.hub is not None
        for session in self._admitted(now):
            self.table.open(session, now)
            self.hub.attach(session)
            log.info("session %d opened (%d live)", session, len(self.table.live))
            self.outer.follow_live(len(self.table.live))  # Delayed Nesterov's N follows the live set
        for session in list(self.table.live):
            self.table.beat(session, self.hub.host.beats(session), now)
        for session in self.table.expired(now):
            self._end(session, "expired")
        if self.table.live:
            self._idle_since = now
            self._first_session = self._first_session or now

    def _admitted(self, now: float) -> list[int]:
        """Newly registered sessions that may open, in id order: all of them without a token; with one, those
        whose worker proved it knows it (a wrong proof, or none within ``lease_s``, is refused)."""
        assert self.hub is not None
        registered = self.hub.host.registered()
        self._pending.update({s: now for s in range(self._scanned + 1, registered + 1)})
        self._scanned = max(self._scanned, registered)
        admitted = []
        for session, since in sorted(self._pending.items()):
            proof = None if self.token is None else self.hub.host.proof(session)
            if self.token is not None and proof is None and now - since < self.table.lease_s:
                continue  # registered a moment ago: its proof follows
            ok = self.token is None or (proof is not None and proof_matches(self.token, session, proof))
            if self.token is not None:
                self.hub.host.decide(session, ok)
            del self._pending[session]
            if ok:
                admitted.append(session)
            else:
                self.table.refuse(session, "refused: wrong token")
                log.warning("session %d refused: its worker's token does not match", session)
        return admitted

    def _end(self, session: int, reason: str, flush: bool = False) -> None:
        """End a session: its group is torn down (with ``flush``, once its queued replies are sent), its in-flight
        steps and buffers released, parked workers reconsidered (they may get its share)."""
        assert self.hub is not None
        if not self.table.end(session, reason):
            return
        log.info("session %d ended (%s); %d live", session, reason, len(self.table.live))
        self.hub.drop(session, flush=flush, unresponsive=reason == "expired" or reason.startswith("lost"))
        self._parked.pop(session, None)
        self.outer.release(session)
        self.outer.follow_live(len(self.table.live))
        self._retry_parked()

    # the exchange
    def _collect(self, first: Push) -> list[Push]:
        """One batch: the first push, then those of other live sessions within ``grace_period`` of it."""
        batch = [first]
        deadline = time.monotonic() + self.outer.step_policy.batch_window
        while not set(self.table.live) <= {p.worker for p in batch}:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            push = self._next(left)
            if push is not None:
                batch.append(push)
        return [p for p in batch if self.table.is_live(p.worker)]

    def _apply(self, batch: list[Push]) -> None:
        if not batch:
            return
        for session, steps in self.outer.process(batch).items():
            self._answer(session, steps, next(p for p in batch if p.worker == session))
        for push in batch:
            if push.kind == Kind.BYE:
                self._end(push.worker, "left")
            elif self.outer.excluded(push.worker):  # told to stop: its session ends, its share goes to the others
                self._end(push.worker, f"excluded: {self.outer.rejection_streak(push.worker)} pushes in a row rejected",
                          flush=True)
        self.outer.follow_live(len(self.table.live))
        self._retry_parked()
        self._after_update()

    def _answer(self, session: int, steps: int, push: Push) -> None:
        """Reply with the next round, or park the worker (see :func:`~.sessions.should_park`)."""
        assert self.hub is not None
        left = None if self.budget is None else self.budget - self.outer.steps_done
        others = sum(s.in_flight for w, s in self.outer.workers.items() if w != session and self.table.is_live(w))
        if should_park(steps, left, others) and not self.outer.excluded(session):
            self._parked[session] = push
            return
        try:
            header = ServerHeader(steps, self.outer.outer_updates, self.outer.rejection_streak(session))
            self.hub.reply(session, header, self.outer.params.detach(), self.outer.buffers)
            if steps > 0:  # the model travels (a stop carries none): counted, as the pushes are
                self.outer.mark_pulled(session, self._layout.reply_nbytes(-1) + 4 * self.outer.buffers.numel())
        except SessionLost as err:
            self._end(session, f"lost: {err}")

    def _retry_parked(self) -> None:
        """Ask again for each parked worker's round, as if it had just said hello (no steps, nothing pushed)."""
        for session, push in list(self._parked.items()):
            del self._parked[session]
            again = replace(push, kind=Kind.HELLO, steps=0, pseudo_gradient=None, inner_state=None, buffers=None,
                            payload_bytes=0)
            for worker, steps in self.outer.process([again]).items():
                self._answer(worker, steps, again)

    def _after_update(self) -> None:
        updates = self.outer.outer_updates
        if self.evaluate is not None and self.evaluate_every and updates >= self._marks["evaluate"] + self.evaluate_every:
            self._marks["evaluate"] = updates
            self._write_global_model()
            self._evaluate()
        if updates >= self._marks["checkpoint"] + self.checkpoint_every:
            self._marks["checkpoint"] = updates
            self.save()

    # the global model: validation and checkpoints in one place
    def _write_global_model(self) -> None:
        params, buffers = self.outer.global_model()
        device = next(self.module.parameters()).device
        write_from(list(self.module.parameters()), params, device)
        write_from(float_buffers(self.module), buffers, device)

    def _evaluate(self) -> None:
        assert self.evaluate is not None
        metrics = {k: float(v) for k, v in self.evaluate(self.module).items()}
        self.evaluations.append((self.outer.outer_updates, metrics))
        log.info("evaluation at %d outer updates: %s", self.outer.outer_updates, metrics)

    @property
    def result(self) -> AsyncResult:
        """What every session did so far, and why each ended (logged when :meth:`run` returns)."""
        return outer_result(self.outer, self.table.ended)

    def status(self) -> dict[str, Any]:
        """Progress, as written beside the checkpoint (``<checkpoint>.status.json``)."""
        return {"outer_updates": self.outer.outer_updates, "steps_done": self.outer.steps_done, "budget": self.budget,
                "live": sorted(self.table.live), "ended": {str(k): v for k, v in sorted(self.table.ended.items())},
                "workers": {str(k): v for k, v in self.outer.worker_stats().items()},
                "evaluations": self.evaluations,
                "elapsed_s": time.monotonic() - self._first_session if self._first_session else 0.0}

    def save(self) -> None:
        """Checkpoint (atomically: a crash leaves the previous file) the outer state, the global model, the next
        session id and the evaluations; and write the status file."""
        if self.checkpoint is None:
            return
        self._write_global_model()
        state = {"format": FORMAT, "outer": self.outer.state_dict(), "next_session": self.table.next_id,
                 "state_dict": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
                 "evaluations": [[u, m] for u, m in self.evaluations]}
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint)
        status = self.checkpoint.with_name(self.checkpoint.name + ".status.json")
        status.with_suffix(".tmp").write_text(json.dumps(self.status()))
        os.replace(status.with_suffix(".tmp"), status)

    def _resume(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint: every session of the previous run is over (its workers open new ones)."""
        require("checkpoint", str(self.checkpoint), state.get("format") == FORMAT, f"a {FORMAT} checkpoint")
        self.outer.load_state_dict(state["outer"])
        for worker in list(self.outer.workers):
            self.outer.release(worker)
        self.table = SessionTable(self.table.lease_s, next_id=int(state["next_session"]))
        self.evaluations = [(int(u), dict(m)) for u, m in state["evaluations"]]
        self._marks = dict.fromkeys(self._marks, self.outer.outer_updates)
        log.info("resumed from %s: %d outer updates, %d inner steps", self.checkpoint, self.outer.outer_updates,
                 self.outer.steps_done)
