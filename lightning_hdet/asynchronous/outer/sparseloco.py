"""SparseLoCo (Sarfi et al., arXiv 2508.15706), all in one file (pure): the object (:class:`SparseLoCo`), its outer
step (:class:`SparseSyncStep`) and the round change its pulls forward (:class:`RoundCodec`, :class:`SparseRound`).

Workers push ``codec(g + beta * residual)`` in a sparse codec (the decayed error feedback stands in for momentum);
rank 0 moves ``G`` by ``-lr`` times the mean of the pushes. That change is exactly sparse, so a pull forwards it: a
*round change* is the pushes as they are, one slot per worker (cheaper than the union's float32 values: 596 bytes a
chunk at W = 4 against up to 1,536), decoded everywhere with the same float32 operations in the same order, so every
copy is ``G`` bit for bit. A worker's pull leaves out its own slot, which it fills with the bytes it pushed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import check_number, require
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterovOptimizer
from lightning_hdet.asynchronous.outer.state import OuterState, StepPolicy, SyncStep
from lightning_hdet.asynchronous.wire.codecs import Codec, TopK

#: SparseLoCo's error-feedback decay ``beta`` (the paper's setting), the default of ``error_decay``.
SPARSELOCO_DECAY = 0.95
_FACTOR_BYTES = 4  # the step's factor, float32


class RoundCodec:
    """One fragment's round change: the factor ``-lr / pushes``, then each worker's push (or zeros)."""

    raw = False

    def __init__(self, codec: Codec, workers: int) -> None:
        if codec.sparse is None:
            raise ValueError(f"A round change forwards sparse pushes; the pushes' codec is {codec!r}.")
        self.codec, self.workers = codec, workers
        self.numel = codec.numel
        self.slot_bytes = -(-codec.nbytes // 4) * 4  # a multiple of 4: each slot's float32 scales stay aligned
        self.nbytes = _FACTOR_BYTES + workers * self.slot_bytes

    def slot(self, message: Tensor, worker: int) -> Tensor:
        """``worker``'s push message inside ``message`` (a view)."""
        start = _FACTOR_BYTES + worker * self.slot_bytes
        return message[start : start + self.codec.nbytes]

    def around(self, message: Tensor, worker: int) -> list[Tensor]:
        """The views of ``message`` before and after ``worker``'s slot (what a pull to ``worker`` carries)."""
        start = _FACTOR_BYTES + worker * self.slot_bytes
        return [piece for piece in (message[:start], message[start + self.slot_bytes : self.nbytes]) if piece.numel()]

    @torch.no_grad()
    def decode(self, message: Tensor, out: Tensor) -> Tensor:
        """``factor * sum(slots)`` into ``out`` (a zero slot adds zeros)."""
        if message.numel() != self.nbytes or message.dtype != torch.uint8:
            raise ValueError(f"A round change has {self.nbytes} bytes, got {message.numel()} {message.dtype}.")
        assert self.codec.sparse is not None
        out.zero_()
        for worker in range(self.workers):
            self.codec.sparse.add_into(self.slot(message, worker), out)
        return out.mul_(message[:_FACTOR_BYTES].view(torch.float32))


class SparseRound:
    """Rank 0's round being gathered: each applied push's messages in its worker's slot, until :meth:`close`."""

    def __init__(self, codecs: Sequence[Codec], workers: int) -> None:
        self.codecs = [RoundCodec(c, workers) for c in codecs]
        self._slots = [torch.zeros(c.nbytes, dtype=torch.uint8) for c in self.codecs]
        self.change: list[Tensor] = []
        self.scratch = torch.empty(max((c.numel for c in self.codecs), default=0), dtype=torch.float32)

    def keeping(self, worker: int, messages: Iterable[Tensor]) -> Iterator[Tensor]:
        """``messages`` passed on, each copied into ``worker``'s slot first."""
        for index, message in enumerate(messages):
            self.codecs[index].slot(self._slots[index], worker).copy_(message)
            yield message

    def drop(self, worker: int) -> None:
        """``worker``'s push was rejected: its slots go back to zeros."""
        for codec, slots in zip(self.codecs, self._slots):
            codec.slot(slots, worker).zero_()

    def close(self, pushes: int, lr: float) -> list[Tensor]:
        """The round's change (``factor = -lr / pushes``), now :attr:`change`; the slots are zeros again."""
        self.change = []
        for slots in self._slots:
            message = slots.clone()
            message[:_FACTOR_BYTES].view(torch.float32).fill_(-lr / pushes)
            self.change.append(message)
            slots.zero_()
        return self.change


class SparseSyncStep(SyncStep):
    """DiLoCo with SparseLoCo's update: the model moves by :class:`SparseRound`'s change; no momentum."""

    def __init__(self, lr: float) -> None:
        super().__init__()  # rounds of H steps: SparseLoCo.check refuses stagger
        self.lr = lr
        self.round: SparseRound | None = None

    def attach(self, sparse_round: SparseRound) -> None:
        self.round = sparse_round

    def keeps_messages(self, codecs: list, workers: int) -> SparseRound:
        self.round = SparseRound(codecs, workers)
        return self.round

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        pass  # the round's messages are in self.round already

    def close(self, outer: OuterState, pushes: int) -> None:
        if not pushes:
            return
        if self.round is None:
            raise RuntimeError("SparseLoCo steps from the pushes' messages; no server attached its round.")
        scratch = self.round.scratch
        for (start, end), codec, message in zip(outer.ranges, self.round.codecs, self.round.close(pushes, self.lr)):
            outer.params[start:end].add_(codec.decode(message, scratch[: end - start]))
        outer.outer_updates += 1


@dataclass(frozen=True)
class SparseLoCo(OuterOptimizer):
    """SparseLoCo's outer step, DiLoCo only, with ``compression=TopK(...)``: ``lr`` times the mean of the round's
    sparse pushes, no outer momentum, so sparse pulls (the same codec) can send its change exactly.

    Args:
        lr: the outer lr ``alpha`` (> 0; the paper's 1).
        error_decay: ``beta`` in [0, 1], the weight of what a worker's codec left out in its next push (the
            paper's 0.95).
    """

    forwards_rounds: ClassVar[bool] = True
    lr: float = 1.0
    error_decay: float = SPARSELOCO_DECAY

    def __post_init__(self) -> None:
        check_number("lr", self.lr, low=0, low_open=True)
        check_number("error_decay", self.error_decay, 0.0, 1.0, hint=f"SparseLoCo's is {SPARSELOCO_DECAY}.")

    def check(self, mode: str, stagger: int) -> None:
        require("mode", mode, mode == "sync", "'sync' (DiLoCo) with SparseLoCo",
                "Its update is the mean of every worker's round. Use mode='sync' or another `outer`.")
        # SparseRound files a push's messages by their position in the push and closes a round with one factor
        # (-lr / pushes) for every fragment: a staggered push carries one part, and the goodbye all of them
        require("stagger", stagger, stagger == 1, "1 with SparseLoCo", "Its round change forwards whole-model pushes"
                " with one step factor per round, while a staggered push carries one part of the model.")

    def check_codecs(self, push: Codec, pull: Codec) -> None:
        require("compression", push, isinstance(push, TopK), "a TopK codec ('topk2' or 'topk4') with SparseLoCo",
                "A dense codec would change every value each round: the update would not be sparse.")

    def feedback_decay(self) -> float | None:
        return self.error_decay

    def forward(self, workers: int) -> Callable[[Codec], RoundCodec]:
        return lambda codec: RoundCodec(codec, workers)

    def optimizer(self, views: Sequence[Tensor], mode: str, workers: int) -> Optimizer:
        # no momentum, no state: stepped by SparseSyncStep itself; kept for the checkpoint's fragment layout
        return DelayedNesterovOptimizer(views, lr=self.lr, momentum=0.0)

    def step_policy(self, mode: str, stagger: int, grace_period: float | None) -> StepPolicy:
        return SparseSyncStep(self.lr)
