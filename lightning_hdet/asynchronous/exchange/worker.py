"""One worker's side (no Lightning, no process groups): it counts its round and, at its end, pushes ``theta_pulled -
theta_local`` fragment by fragment through one fragment-sized host buffer, then pulls the global model."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._tensors import (flat_pieces, float_buffers, host_buffer, model_state, numel, read_into,
                                     state_to_bytes, write_from)
from lightning_hdet.asynchronous.wire.codecs import Codec, ErrorFeedback, NoCodec
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport

log = logging.getLogger(__name__)


class Worker:
    """A worker's round bookkeeping and exchange (``optimizer``: cleared after a rejected push; ``check_self``: a
    non-finite round is discarded, pushed without steps)."""

    def __init__(self, module: Module, device: torch.device, transport: WorkerTransport,
                 inner_optimizer: Optimizer | None = None, layout: Fragments | None = None,
                 error_feedback: bool = True, optimizer: Optimizer | None = None, check_self: bool = True,
                 error_decay: float = 1.0) -> None:
        self.module, self.device, self.transport, self.inner_optimizer = module, device, transport, inner_optimizer
        self.optimizer, self.check_self = optimizer, check_self
        self.name = "this worker"  # in warnings (the strategies say which rank or session)
        self.rejected = 0  # its latest pushes rejected in a row
        self.discarded = 0  # rounds it discarded itself (non-finite)
        shapes = [p.shape for p in module.parameters()]
        self.n_params = numel(list(module.parameters()))
        self.layout = layout or Fragments(shapes)
        whole = replace(self.layout.codecs[0]) if self.layout.codecs else NoCodec()  # the fragments' codec, unbound
        self.feedback = ErrorFeedback(whole.bind(shapes), error_feedback, error_decay)
        self.pulled = host_buffer(numel(model_state(module)), device)  # theta_pulled, then the global buffers
        # one fragment of the push at a time, and this worker's buffer values
        self.fragment = host_buffer(self.layout.largest, device)
        encoded = [c.nbytes for c in self.layout.codecs if not c.raw]  # a raw codec sends the fragment's bytes
        self.message = torch.empty(max(encoded, default=0), dtype=torch.uint8)
        self.buffers = host_buffer(numel(float_buffers(module)), device)
        self.rounds: list[tuple[int, int]] = []
        self.inner_steps = 0
        self.steps_in_round = 0
        self.exchanges = 0
        self.checkpoints = 0  # rank 0's checkpoint requests so far, as its last reply said
        self.round_steps: float = 0  # inf once the server said stop
        self.pulled_lent = False
        self.wait_s = 0.0
        self.round_start = time.perf_counter()

    @property
    def stopped(self) -> bool:
        """The server said stop (its last reply had no steps)."""
        return math.isinf(self.round_steps)

    def step(self) -> bool:
        """Count one inner step; True when the round is complete (time to exchange)."""
        self.steps_in_round += 1
        self.inner_steps += 1
        return self.steps_in_round >= self.round_steps

    def exchange(self, kind: Kind) -> None:
        """Push this round and, unless leaving, pull the next round's length and the global model into the module."""
        compute_s = time.perf_counter() - self.round_start
        start = time.perf_counter()  # reading, encoding and serializing count as exchange time
        header, buffers, inner = self._outgoing(kind, compute_s)
        self.transport.push(header, self._messages() if header.steps > 0 else iter(()), buffers, inner)
        if kind == Kind.BYE:
            return
        reply = self.transport.pull(self.pulled)
        self.wait_s = time.perf_counter() - start
        if self._adopt(reply):
            self.write_pulled()
        self.round_start = time.perf_counter()

    def write_pulled(self) -> None:
        write_from(model_state(self.module), self.pulled, self.device)

    def _outgoing(self, kind: Kind, compute_s: float, pending: int = 0,
                  part: int = -1) -> tuple[WorkerHeader, Tensor | None, Tensor | None]:
        """The header of this round's push (steps 0 when nothing may be pushed), its buffer values and inner state."""
        steps = self.steps_in_round
        if self.pulled_lent and steps:  # no pulled model to push a pseudo-gradient against
            log.warning("%s: %d step(s) after it was told to stop are not pushed.", self.name, steps)
            steps = 0
        buffers = None
        if steps > 0 and self.buffers.numel():
            buffers = read_into(float_buffers(self.module), self.buffers, self.device)
        if steps > 0 and self.check_self and not self._finite(buffers):
            self.discarded += 1
            log.warning("%s: its local steps went non-finite; its round of %d step(s) is discarded, not pushed.",
                        self.name, steps)
            steps, buffers = 0, None
        # serialized now: a snapshot, since the optimizer keeps updating its tensors in place
        inner = state_to_bytes(self.inner_optimizer.state_dict()) if self.inner_optimizer is not None else None
        log.debug("push %s after %d step(s)", kind.name, steps)
        self.exchanges += 1
        header = WorkerHeader(kind, steps, compute_s, self.wait_s, inner.numel() if inner is not None else 0,
                              pending if steps > 0 else 0, part)
        return header, buffers, inner

    def _adopt(self, reply: ServerHeader) -> bool:
        """Take the reply's next round; True when it brought a model to continue from."""
        log.debug("pulled version %d, next round %d step(s)", reply.outer_updates, reply.next_local_steps)
        self.steps_in_round = 0
        self.checkpoints = max(self.checkpoints, reply.checkpoints)
        self.rounds.append((reply.next_local_steps, reply.outer_updates))
        self._recover(reply.rejected, reply.next_local_steps == 0)
        if reply.next_local_steps == 0:
            self.round_steps = math.inf  # the loop would otherwise run one more batch before it stops
            return False
        self.round_steps = reply.next_local_steps
        return True

    def _finite(self, buffers: Tensor | None) -> bool:
        """The local parameters (one device sync per round) and buffer values are finite."""
        params = [p.detach() for p in self.module.parameters()]
        finite = not params or bool(torch.stack(torch._foreach_norm(params)).isfinite().all())
        return finite and (buffers is None or bool(torch.isfinite(buffers).all()))

    def _recover(self, rejected: int, stop: bool) -> None:
        """After a rejected push: no trace of the bad round stays (residual, inner optimizer state)."""
        self.rejected = rejected
        if not rejected:
            return
        self.feedback.residual.zero_()
        if self.optimizer is not None:
            self.optimizer.state.clear()
        if stop:
            log.error("%s stops: its last %d push(es) in a row were rejected (non-finite or far off the others). The"
                      " other workers go on; see docs/failure_modes.md.", self.name, rejected)
        else:
            log.warning("%s: its round was rejected (%d in a row); it restarts from the global model with a fresh"
                        " inner optimizer state and %g x its inner learning rate this round.", self.name, rejected,
                        self.lr_factor)

    @property
    def lr_factor(self) -> float:
        """The inner lr's multiplier: halved for every rejection in a row after the first."""
        return 0.5 ** max(0, self.rejected - 1)

    @contextmanager
    def inner_lr(self, optimizer: Optimizer) -> Iterator[None]:
        """Inside the block, ``optimizer``'s learning rates are cut by :attr:`lr_factor` (restored after)."""
        factor = self.lr_factor
        if factor == 1.0:
            yield
            return
        saved = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            yield
        finally:
            for group, lr in zip(optimizer.param_groups, saved):
                group["lr"] = lr

    def spare_buffer(self) -> Tensor | None:
        """``theta_pulled`` once not needed (stopped, nothing to push), for rank 0's own model; else ``None``."""
        if not self.stopped or self.steps_in_round:
            return None
        self.pulled_lent = True
        return self.pulled

    def swap_pulled(self) -> None:
        """Swap the model and ``theta_pulled`` (again: back), a fragment at a time: no model-sized copy."""
        tensors, total = model_state(self.module), self.pulled.numel()
        size = self.fragment.numel()
        for start in range(0, total, size):
            end = min(start + size, total)
            pieces, held = flat_pieces(tensors, start, end), self.fragment[: end - start]
            read_into(pieces, held, self.device)
            write_from(pieces, self.pulled[start:end], self.device)
            self.pulled[start:end].copy_(held)

    def _messages(self) -> Iterator[Tensor]:
        """The encoded fragments of ``theta_pulled - theta_local``, one at a time through the fragment buffer."""
        params = list(self.module.parameters())
        for fragment, codec in zip(self.layout.fragments, self.layout.codecs):
            values = read_into(flat_pieces(params, fragment.start, fragment.end), self.fragment[: fragment.numel],
                               self.device)
            torch.sub(self.pulled[fragment.start : fragment.end], values, out=values)
            yield self._encode(codec, values, fragment.start)

    def _encode(self, codec: Codec, gradient: Tensor, start: int) -> Tensor:
        out = None if codec.raw else self.message[: codec.nbytes]
        return self.feedback.encode_part(codec, gradient, start, out)
