"""A worker whose exchange overlaps its compute (no Lightning, no process groups).

With ``overlap_steps=τ`` a worker pushes ``τ`` steps before its round ends, trains on while the push and pull
travel, then merges ``θ ← θ_global_new + (θ_local_now − θ_local_at_send)``; ``θ_global_new`` is its next reference.

Why this merge and not Streaming DiLoCo's mix ``α θ_local_now + (1 − α) θ_global_new`` (arXiv 2501.18512):

* **No step is lost or counted twice**: the ``τ`` steps' displacement moves onto the new global model whole and
  goes into the next push whole, so ``max_steps`` stays an exact budget; the mix keeps only ``α`` of it.
* **``τ = 0`` is the blocking exchange, bit for bit**, with no second knob (``α``).
* **First-order, it is the blocking worker's round**: the overlapped gradients were taken at ``θ_local_at_send``
  instead of ``θ_global_new``, an ``O(lr · τ · ‖∇²L‖ · ‖θ_local_at_send − θ_global_new‖)`` delay of the kind async
  pushes already carry (as "eager updates", arXiv 2502.12996). With a conservative outer lr that gap is not
  small: the loss at a fixed budget grows with ``τ / H`` (``benchmarks/overlap_link.py``, ``docs/async.md``).

**Staggered parts** (``stagger=F``, DiLoCo; Streaming DiLoCo's schedule): rounds of ``H / F`` steps, push ``i``
carries part ``i mod F`` (:func:`~.messages.stagger_parts`), so each part syncs every ``H`` steps at its own offset
and each exchange is ``1 / F`` of the bytes. The merge applies to the part that travelled (and the buffers); the
goodbye carries every part's steps since its last exchange, which is why a staggered run needs ``τ >= 1``.

The push's ``pending`` keeps the ``τ`` steps out of the budget left until the next push carries them. A remote worker
keeps ``θ_at_send`` in :attr:`OverlapWorker.sent` and exchanges in a background thread; rank 0's (DiLoCo only) keeps
it in ``θ_pulled`` and merges the global model piece by piece from the outer state: no extra model copy on rank 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_hdet._tensors import add_from, flat_pieces, host_buffer, model_state, read_into, write_from
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.wire.codecs import Codec
from lightning_hdet.asynchronous.wire.messages import Fragment, Kind, ServerHeader
from lightning_hdet.asynchronous.wire.transport import InProcessTransport


def overlap_this_round(overlap_steps: int, allocated: int, carried: int) -> int:
    """How many of a round's ``allocated`` steps come after its push: at most the round, leaving the push a step
    (``carried``: the previous round's overlapped steps)."""
    return max(0, min(overlap_steps, allocated, carried + allocated - 1))


def correction(global_new: Tensor, at_send: Tensor) -> Tensor:
    """``global_new − at_send``, into ``at_send`` (no temporary): added to the model it gives the merge above."""
    return at_send.neg_().add_(global_new)


class _Flight:
    """A remote worker's exchange (``run``: the push, then the pull) in a background thread."""

    def __init__(self, run: Callable[[], ServerHeader]) -> None:
        self.reply: ServerHeader | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(run,), name="async-local-sgd-exchange", daemon=True)
        self.thread.start()

    def _run(self, run: Callable[[], ServerHeader]) -> None:
        try:
            self.reply = run()
        except BaseException as err:  # raised in the training thread, at the merge
            self.error = err

    def wait(self) -> ServerHeader:
        self.thread.join()  # bounded: the transport's own waits time out
        if self.error is not None:
            raise RuntimeError("This worker's exchange failed while it trained on.") from self.error
        assert self.reply is not None
        return self.reply


class OverlapWorker(Worker):
    """A :class:`~.worker.Worker` that sends ``overlap_steps`` before its round ends and merges after them."""

    def __init__(self, *args: Any, overlap_steps: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap_steps = overlap_steps
        # rank 0's own transport merges in place (kept aside, should a SlowLink wrap it)
        self.local = self.transport if isinstance(self.transport, InProcessTransport) else None
        self.in_place = self.local is not None
        self.sent = host_buffer(0 if self.in_place else self.pulled.numel(), self.device)  # θ_at_send (remote)
        self.overlap = 0
        self.since_merge = 0
        self._sending = False  # an exchange is travelling (sent, not merged)
        self._flight: _Flight | None = None
        self._carry = False  # the push in flight carried steps: its overlapped steps are carried onto the reply
        self._compute_s = 0.0  # compute seconds of the steps in the next push, before the current stretch
        # staggered, push i carries part i mod F (every worker's i-th push is in the same round); -1: all
        self.pushes = 0
        self.part = -1

    def step(self) -> bool:
        """Count one inner step; True when it is time to send, or (while an exchange travels) to merge."""
        super().step()
        self.since_merge += 1
        if self._sending:
            return self.steps_in_round >= self.overlap
        return self.since_merge >= self.round_steps - self.overlap

    def exchange(self, kind: Kind) -> None:
        """``HELLO`` as blocking; ``PUSH``: send, or merge; ``BYE``: merge, push what is left and leave."""
        if kind == Kind.HELLO:
            super().exchange(kind)
            self._next_round()
            return
        if self._sending:
            self._merge()
        if kind == Kind.BYE:
            self.round_start -= self._compute_s  # the goodbye's compute seconds include its overlapped steps
            super().exchange(kind)
            return
        if self.stopped or self.since_merge < self.round_steps - self.overlap:
            return  # merged; the round goes on
        self._send()
        if self.overlap == 0:  # this round has no room to overlap (e.g. a first round of one step)
            self._merge()

    def _next_round(self) -> None:
        self.since_merge = 0
        if not self.stopped:
            self.overlap = overlap_this_round(self.overlap_steps, int(self.round_steps), self.steps_in_round)

    def _send(self) -> None:
        start = time.perf_counter()
        parts = len(self.layout.parts)
        self.part, self.pushes = self.pushes % parts if parts > 1 else -1, self.pushes + 1
        header, buffers, inner = self._outgoing(Kind.PUSH, self._compute_s + start - self.round_start, self.overlap,
                                                self.part)
        self._carry, steps = header.steps > 0, header.steps
        if self.in_place:
            kept = self._keep_sent(self.part) if steps else iter(())
            self.transport.push(header, kept, buffers, inner)
            for _ in kept:  # a reader may stop at the last fragment (a zip): its θ_at_send is written on resuming
                pass
            if steps and buffers is not None:
                self.pulled[self.layout.numel :].copy_(buffers)
        else:
            if steps:
                read_into(model_state(self.module), self.sent, self.device)

            def run() -> ServerHeader:
                self.transport.push(header, self._from_sent(self.part) if steps else iter(()), buffers, inner)
                return self.transport.pull(self.pulled)
            self._flight = _Flight(run)
        self._sending, self.steps_in_round, self._compute_s = True, 0, 0.0
        self.wait_s = time.perf_counter() - start  # the blocking part of this exchange; the merge adds its own
        self.round_start = time.perf_counter()

    def _merge(self) -> None:
        start = time.perf_counter()
        self._compute_s += start - self.round_start
        carried = self.steps_in_round
        if self.in_place:
            assert self.local is not None
            reply = self.local.pull(self.pulled, self._combine)
        else:
            assert self._flight is not None
            reply, self._flight = self._flight.wait(), None
        carry = self._carry and reply.rejected == 0  # a rejected or discarded round is not carried on
        start_part, end_part = self.layout.span(self.part)
        adopted = self._adopt(reply)
        if adopted and self.in_place and not carry and len(self.layout.parts) > 1:
            # rank 0, staggered, a round not carried on (rejected, or discarded): every part back to its reference,
            # as a remote worker does below; the pull rewrote only the part that travelled
            write_from(model_state(self.module), self.pulled, self.device)
        if adopted and not self.in_place:
            if carry:  # the part that travelled, and the buffers; the other parts train on untouched
                state = model_state(self.module)
                for s, e in ((start_part, end_part), (self.n_params, self.pulled.numel())):
                    add_from(flat_pieces(state, s, e), correction(self.pulled[s:e], self.sent[s:e]), self.device)
            else:  # restarts from the pulled model: the other parts' references (all of it, not staggered)
                write_from(model_state(self.module), self.pulled, self.device)
        elif self.stopped and not self.in_place:  # the goodbye pushes the part's overlapped steps against θ_at_send
            self.pulled[start_part:end_part].copy_(self.sent[start_part:end_part])
        if carry:
            self.steps_in_round = carried
        self._sending = False
        self._next_round()
        self.wait_s += time.perf_counter() - start
        self.round_start = time.perf_counter()

    def _combine(self, reply: ServerHeader, start: int, values: Tensor) -> None:
        """Rank 0: merge one piece of the global model; ``pulled`` then holds it (the next reference)."""
        end = start + values.numel()
        pieces, kept = flat_pieces(model_state(self.module), start, end), self.pulled[start:end]
        if self._carry and reply.rejected == 0:
            add_from(pieces, correction(values, kept), self.device)
        else:
            write_from(pieces, values, self.device)
        kept.copy_(values)

    def _from_sent(self, part: int) -> Iterator[Tensor]:
        """A remote worker's push: the encoded fragments of ``θ_pulled − θ_at_send``."""
        for fragment, codec in self._fragments(part):
            gradient = self.fragment[: fragment.numel]
            torch.sub(self.pulled[fragment.start : fragment.end], self.sent[fragment.start : fragment.end],
                      out=gradient)
            yield self._encode(codec, gradient, fragment.start)

    def _keep_sent(self, part: int) -> Iterator[Tensor]:
        """Rank 0's push; ``pulled`` then holds ``θ_at_send`` (written after each message: it may be a view)."""
        params = list(self.module.parameters())
        for fragment, codec in self._fragments(part):
            local = read_into(flat_pieces(params, fragment.start, fragment.end), self.fragment[: fragment.numel],
                              self.device)
            gradient = self.pulled[fragment.start : fragment.end]
            yield self._encode(codec, gradient.sub_(local), fragment.start)
            gradient.copy_(local)

    def _fragments(self, part: int) -> Iterator[tuple[Fragment, Codec]]:
        return ((self.layout.fragments[i], self.layout.codecs[i]) for i in self.layout.indices(part))
