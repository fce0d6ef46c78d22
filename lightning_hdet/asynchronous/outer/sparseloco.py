"""SparseLoCo's outer update (Sarfi et al., arXiv 2508.15706) and its exact sparse pulls. Pure tensor code: no
Lightning, no process groups.

With ``outer="sparseloco"`` (DiLoCo only) each worker pushes ``codec(g + beta * residual)`` in a sparse codec
(``"topk2"`` / ``"topk4"``) and keeps what it did not send (:class:`~.compression.ErrorFeedback` with ``decay =
beta``: the decayed accumulator stands in for the outer momentum); rank 0 moves the global model ``G`` by
``-lr`` times the mean of the decoded pushes and keeps no momentum. ``G``'s change is then exactly sparse (the
union of the workers' kept values), so a pull can carry it exactly: a *round change* is the round's pushes
forwarded as they are, one slot per worker, with the step's factor ``-lr / pushes``. Rank 0 moves ``G`` by
decoding the same bytes a worker decodes, with the same float32 operations in the same order
(:meth:`RoundCodec.decode`), so the public model and every worker's copy stay equal to ``G`` bit for bit.

Why forward the pushes rather than the union's values: a chunk of 4,096 values costs a worker's ``topk2`` push 148
bytes (a scale, 64 int16 positions, 64 2-bit levels), so the round of W = 4 forwarded costs 596 bytes; the
union's up to 256 positions with exact float32 values cost up to 1,536. A worker's pull leaves out its own slot
(:meth:`RoundCodec.around`; 448 bytes at W = 4): it fills the slot with the bytes it pushed, which rank 0 forwards
to the others, and sums the slots in the same order, so it still holds ``G`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from lightning_hdet._checks import check_number, require
from lightning_hdet.asynchronous.wire.codecs import Codec

#: SparseLoCo's error-feedback decay ``beta`` (the paper's setting), the default of ``error_decay``.
SPARSELOCO_DECAY = 0.95
_FACTOR_BYTES = 4  # the step's factor, float32


def _padded(nbytes: int) -> int:
    """A slot's bytes rounded up to a multiple of 4, so that each slot's float32 scales stay aligned."""
    return -(-nbytes // 4) * 4


class RoundCodec:
    """One fragment's round change: the float32 factor ``-lr / pushes``, then ``workers`` slots, each one push
    message of ``codec`` (a sparse codec) or zeros (that worker did not push). It decodes to ``factor * (slot 0 +
    slot 1 + ...)``, summed into zeros slot by slot, one float32 addition per kept value.

    Args:
        codec: the pushes' codec for this fragment (``"topk2"`` or ``"topk4"``).
        workers: slots per change (the number of workers).
    """

    name = "round"

    def __init__(self, codec: Codec, workers: int) -> None:
        if codec.sparse is None:
            raise ValueError(f"A round change forwards sparse pushes; the pushes' codec is {codec.name!r}.")
        self.codec, self.workers = codec, workers
        self.numel = codec.numel
        self.slot_bytes = _padded(codec.nbytes)
        self.nbytes = _FACTOR_BYTES + workers * self.slot_bytes

    def slot(self, message: Tensor, worker: int) -> Tensor:
        """``worker``'s push message inside ``message`` (a view)."""
        start = _FACTOR_BYTES + worker * self.slot_bytes
        return message[start : start + self.codec.nbytes]

    def around(self, message: Tensor, worker: int) -> list[Tensor]:
        """``message`` without ``worker``'s slot, as a pull to ``worker`` carries it: the views before and after
        the slot (an empty one left out); ``worker`` writes its own push into the slot (:meth:`slot`)."""
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
    """Rank 0's round being gathered: each applied push's messages in its worker's slot, until the outer step
    closes the round into its change (:meth:`close`). Holds one change (``W`` pushes, under 2 % of a model).

    Args:
        codecs: the pushes' codec of each fragment.
        workers: how many workers push.
    """

    def __init__(self, codecs: Sequence[Codec], workers: int) -> None:
        self.codecs = [RoundCodec(c, workers) for c in codecs]
        self._slots = [torch.zeros(c.nbytes, dtype=torch.uint8) for c in self.codecs]
        #: The last closed round's change, one message per fragment (logged for the pulls).
        self.change: list[Tensor] = []
        self.scratch = torch.empty(max((c.numel for c in self.codecs), default=0), dtype=torch.float32)

    def keeping(self, worker: int, messages: Iterable[Tensor]) -> Iterator[Tensor]:
        """``messages`` (a push's fragments, in order) passed on, each copied into ``worker``'s slot first."""
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


def check_sparse_outer(sparse: bool, compression: str, error_decay: float | None) -> float | None:
    """The arguments ``outer="sparseloco"`` depends on (its ``mode`` and momentum options are
    :class:`~.outer.OuterSettings`'); returns the error feedback's decay in force (``None``
    without it: plain error feedback). Raises the package's ``ValueError`` naming the argument."""
    if not sparse:
        require("error_decay", error_decay, error_decay is None, "None without outer='sparseloco'",
                "The decayed error feedback stands in for SparseLoCo's outer momentum; a dense outer step has its own.")
        return None
    require("compression", compression, str(compression).startswith("topk"), "'topk2' or 'topk4' with"
            " outer='sparseloco'", "A dense codec would change every value each round: the update would not be sparse.")
    decay = SPARSELOCO_DECAY if error_decay is None else error_decay
    check_number("error_decay", decay, 0.0, 1.0, hint=f"SparseLoCo's is {SPARSELOCO_DECAY}.")
    return float(decay)
