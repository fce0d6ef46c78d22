"""The exchange's wire format, as code. Pure: no process groups, no Lightning.

One exchange is a push from a worker to the server on rank 0, then (unless the worker leaves) the server's reply.

Worker -> server, in this order:

1. a :class:`WorkerHeader` (``float64[5]``);
2. when ``steps > 0``: one flat ``float32`` payload, the pseudo-gradient of the parameters
   (``theta_pulled - theta_local``) followed by the current *values* of the floating-point buffers;
3. when ``inner_state_bytes > 0``: the worker's serialized inner optimizer state (``uint8[inner_state_bytes]``).

Server -> worker, in this order:

1. a :class:`ServerHeader` (``float64[2]``);
2. when ``next_local_steps > 0``: the flat ``float32`` global parameters, then (only if the model has
   floating-point buffers, as a second message) the flat global buffers.

Headers are ``float64`` so that step counts and seconds share one tensor exactly (integers up to 2**53).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import torch
from torch import Tensor


class Kind(IntEnum):
    """What a worker's message means."""

    #: The first message of a worker (no steps taken yet): asks for the global model and a round length.
    HELLO = 0
    #: The end of a round: carries the round's pseudo-gradient and buffers, asks for the next round.
    PUSH = 1
    #: The worker leaves (end of ``fit``); it may carry an unfinished round, and gets no reply.
    BYE = 2


def _decode(tensor: Tensor, size: int, name: str) -> list[float]:
    if tensor.dtype != torch.float64 or tensor.numel() != size:
        raise ValueError(f"A {name} is float64[{size}], got {tensor.dtype}[{tensor.numel()}].")
    return tensor.tolist()


@dataclass(frozen=True)
class WorkerHeader:
    """The header of a worker's message (``float64[5]``, fields in this order)."""

    #: What the message means.
    kind: Kind
    #: Inner steps of the round just ended; when > 0 the flat payload follows.
    steps: int
    #: Seconds the round's steps took (the worker's speed is ``steps / compute_s``).
    compute_s: float
    #: Seconds the worker's previous exchange took (push, then waiting for the reply).
    wait_s: float
    #: Size of the serialized inner optimizer state that follows (0: none is sent).
    inner_state_bytes: int = 0

    SIZE: ClassVar[int] = 5

    def encode(self) -> Tensor:
        return torch.tensor([float(self.kind), float(self.steps), self.compute_s, self.wait_s,
                             float(self.inner_state_bytes)], dtype=torch.float64)

    @classmethod
    def decode(cls, tensor: Tensor) -> WorkerHeader:
        kind, steps, compute_s, wait_s, state_bytes = _decode(tensor, cls.SIZE, "worker header")
        return cls(Kind(int(kind)), int(steps), compute_s, wait_s, int(state_bytes))


@dataclass(frozen=True)
class ServerHeader:
    """The header of the server's reply (``float64[2]``, fields in this order)."""

    #: Inner steps of the worker's next round; 0 means stop (no model follows).
    next_local_steps: int
    #: How many outer updates the global model that follows has had (the version the worker pulls).
    outer_updates: int

    SIZE: ClassVar[int] = 2

    def encode(self) -> Tensor:
        return torch.tensor([float(self.next_local_steps), float(self.outer_updates)], dtype=torch.float64)

    @classmethod
    def decode(cls, tensor: Tensor) -> ServerHeader:
        steps, outer_updates = _decode(tensor, cls.SIZE, "server header")
        return cls(int(steps), int(outer_updates))


@dataclass
class Push:
    """A worker's message as the server sees it, once received (whichever transport carried it)."""

    worker: int
    kind: Kind
    steps: int
    compute_s: float
    wait_s: float
    #: ``theta_pulled - theta_local`` of the parameters (``None`` when no steps were taken).
    pseudo_gradient: Tensor | None = None
    #: The worker's serialized inner optimizer state (uint8), if sent.
    inner_state: Tensor | None = None
    #: The worker's floating-point buffer values (flat), if sent and the model has any.
    buffers: Tensor | None = None

    @classmethod
    def received(cls, worker: int, header: WorkerHeader, payload: Tensor | None, n_params: int,
                 inner_state: Tensor | None = None) -> Push:
        """Split a flat payload (pseudo-gradient, then buffers). The buffers are copied: the server keeps them,
        and the pseudo-gradient (a view of ``payload``) need not stay alive with them."""
        gradient = buffers = None
        if payload is not None:
            gradient = payload[:n_params]
            if payload.numel() > n_params:
                buffers = payload[n_params:].clone()
        return cls(worker, header.kind, header.steps, header.compute_s, header.wait_s, gradient, inner_state,
                   buffers)
