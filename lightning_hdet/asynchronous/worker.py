"""One worker's side of the exchange: counting its round and, at its end, one exchange over a transport.

An exchange reads the model into a flat host buffer, turns the parameters into the pseudo-gradient
``theta_pulled - theta_local`` (buffers travel as values), pushes it, pulls the new global model into the host
buffer ``theta_pulled`` and writes it into the model. No Lightning and no process groups here: the strategy
calls :meth:`Worker.step` after each inner optimizer step and :meth:`Worker.exchange` at the start and end.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._tensors import host_buffer, model_state, numel, read_into, state_to_bytes, write_from
from lightning_hdet.asynchronous.messages import Kind, WorkerHeader
from lightning_hdet.asynchronous.transport import WorkerTransport

log = logging.getLogger(__name__)


class Worker:
    """A worker's round bookkeeping and exchange.

    Args:
        module: the model (its parameters, then its floating-point buffers, are exchanged).
        device: where the model lives (host buffers are pinned on CUDA).
        transport: how messages reach the server.
        inner_optimizer: when given, each exchange also sends its state (serialized on the host).
    """

    def __init__(self, module: Module, device: torch.device, transport: WorkerTransport,
                 inner_optimizer: Optimizer | None = None) -> None:
        self.module, self.device, self.transport, self.inner_optimizer = module, device, transport, inner_optimizer
        self.n_params = numel(list(module.parameters()))
        size = numel(model_state(module))
        self.pulled = host_buffer(size, device)  # theta_pulled, then the pulled global buffers
        self.local = host_buffer(size, device)  # the push: pseudo-gradient, then this worker's buffer values
        #: One entry per exchange: ``(local_steps_assigned, outer_updates_seen)``.
        self.rounds: list[tuple[int, int]] = []
        self.inner_steps = 0
        self.steps_in_round = 0
        #: Length of the current round; ``inf`` once the server said stop.
        self.round_steps: float = 0
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
        """Push this round (pseudo-gradient and buffers, if any steps were taken; the inner state when sending
        it) and, unless leaving, pull the next round's length and the global model into the module."""
        compute_s = time.perf_counter() - self.round_start
        steps, payload, n = self.steps_in_round, None, self.n_params
        if steps > 0:
            payload = read_into(model_state(self.module), self.local, self.device)
            torch.sub(self.pulled[:n], payload[:n], out=payload[:n])  # the buffers travel as values
        start = time.perf_counter()  # serializing the inner state counts as exchange time
        # serialized now: a snapshot, since the optimizer keeps updating its tensors in place
        inner = state_to_bytes(self.inner_optimizer.state_dict()) if self.inner_optimizer is not None else None
        header = WorkerHeader(kind, steps, compute_s, self.wait_s, inner.numel() if inner is not None else 0)
        log.debug("push %s after %d step(s)", kind.name, steps)
        self.transport.push(header, payload, inner)
        if kind == Kind.BYE:
            return
        reply = self.transport.pull(self.pulled)
        log.debug("pulled version %d, next round %d step(s)", reply.outer_updates, reply.next_local_steps)
        self.wait_s = time.perf_counter() - start
        self.steps_in_round = 0
        self.rounds.append((reply.next_local_steps, reply.outer_updates))
        if reply.next_local_steps == 0:
            self.round_steps = math.inf  # the loop would otherwise run one more batch before it stops
        else:
            self.round_steps = reply.next_local_steps
            write_from(model_state(self.module), self.pulled, self.device)
        self.round_start = time.perf_counter()
