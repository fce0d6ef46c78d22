"""The exchange's wire format, as code. Pure: no process groups, no Lightning.

One exchange is a push from a worker to the server on rank 0, then (unless the worker leaves) the server's reply.
Model-sized vectors travel in **fragments** (:class:`Fragments`: consecutive parameters, or row blocks of a large
one, of at most :data:`FRAGMENT_BYTES` of ``float32`` each, as DDP's 25 MiB buckets), so that rank 0 applies each
fragment as it arrives and never holds a whole model per worker.

Worker -> server, in this order:

1. a :class:`WorkerHeader` (``float64[7]``);
2. when ``steps > 0`` and the model has floating-point buffers: their current *values* (``float32``);
3. when ``inner_state_bytes > 0``: the worker's serialized inner optimizer state (``uint8[inner_state_bytes]``;
   only with ``checkpoint_inner_states=True``, off by default);
4. when ``steps > 0``: one ``uint8`` message per fragment of the header's ``part`` (all, or one part's): that
   fragment of the pseudo-gradient (``theta_pulled - theta_local``) encoded by the fragment's codec
   (:mod:`.codecs`; ``NoCodec``: its ``float32`` bytes).

Server -> worker, in this order:

1. a :class:`ServerHeader` (``float64[6]``);
2. when ``next_local_steps > 0``: the global parameters, one message per fragment encoded by the pull codec
   (``NoCodec``: ``float32``; ``BF16``: the parameters rounded to bfloat16, whose float32 originals stay on rank
   0), or, when the header's ``deltas`` is ``n >= 0``, ``n`` changes of the public model, oldest first, each one
   message per fragment in its delta codec (:mod:`.public_model`; under SparseLoCo a round change, the round's
   pushes forwarded: :mod:`~..outer.sparseloco`); then (only if the model has floating-point buffers) the
   global buffers (``float32``). The parameters are those of the header's ``part`` (all, or the part pushed).

Headers are ``float64`` so that step counts and seconds share one tensor exactly (integers up to 2**53).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_hdet._tensors import BUCKET_BYTES
from lightning_hdet.asynchronous.wire.codecs import DEFAULT_CHUNK, Codec, NoCodec, codec_from

#: Largest fragment of a pushed or pulled model, in bytes of ``float32`` values: the size of HDET's merge buckets
#: (DDP's default bucket size), one number for both.
FRAGMENT_BYTES = BUCKET_BYTES


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
    """The header of a worker's message (``float64[7]``, fields in this order)."""

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
    #: Inner steps of its current round the worker takes after this push, before it merges the reply (its overlap,
    #: see :mod:`.overlap`); they are in its next push. The server keeps them out of the budget left meanwhile.
    pending: int = 0
    #: Which fragments the push carries: ``-1`` all of them, ``p >= 0`` those of part ``p`` of a staggered
    #: layout (:attr:`Fragments.parts`); the reply carries the same ones.
    part: int = -1

    SIZE: ClassVar[int] = 7

    def encode(self) -> Tensor:
        return torch.tensor([float(self.kind), float(self.steps), self.compute_s, self.wait_s,
                             float(self.inner_state_bytes), float(self.pending), float(self.part)],
                            dtype=torch.float64)

    @classmethod
    def decode(cls, tensor: Tensor) -> WorkerHeader:
        kind, steps, compute_s, wait_s, state_bytes, pending, part = _decode(tensor, cls.SIZE, "worker header")
        return cls(Kind(int(kind)), int(steps), compute_s, wait_s, int(state_bytes), int(pending), int(part))


@dataclass(frozen=True)
class ServerHeader:
    """The header of the server's reply (``float64[6]``, fields in this order)."""

    #: Inner steps of the worker's next round; 0 means stop (no model follows).
    next_local_steps: int
    #: How many outer updates the global model that follows has had (the version the worker pulls).
    outer_updates: int
    #: How many of the worker's latest pushes in a row were rejected (0: its last push was applied); the worker
    #: then resets its inner optimizer state (see :mod:`.checks`).
    rejected: int = 0
    #: What follows: ``-1`` the parameters themselves (in the pull codec), ``n >= 0`` the last ``n`` changes of the
    #: public model, each in every fragment's delta codec (:mod:`.public_model`), to add to the worker's own copy.
    deltas: int = -1
    #: Which fragments' parameters follow (:attr:`WorkerHeader.part`: those the worker pushed).
    part: int = -1
    #: How many checkpoint requests rank 0 has made so far (each: write or remove the worker's own file beside a
    #: checkpoint rank 0 wrote or removed; see :mod:`.checkpoints`).
    checkpoints: int = 0

    SIZE: ClassVar[int] = 6

    def encode(self) -> Tensor:
        return torch.tensor([float(self.next_local_steps), float(self.outer_updates), float(self.rejected),
                             float(self.deltas), float(self.part), float(self.checkpoints)], dtype=torch.float64)

    @classmethod
    def decode(cls, tensor: Tensor) -> ServerHeader:
        steps, outer_updates, rejected, deltas, part, checkpoints = _decode(tensor, cls.SIZE, "server header")
        return cls(int(steps), int(outer_updates), int(rejected), int(deltas), int(part), int(checkpoints))


@dataclass
class Push:
    """A worker's message as the server sees it, once its header (and buffers, inner state) arrived; the
    pseudo-gradient's fragments are applied as they arrive and never gathered (``pseudo_gradient`` is only set
    by code that holds a whole push anyway, e.g. tests calling :meth:`~.outer.OuterState.process`)."""

    worker: int
    kind: Kind
    steps: int
    compute_s: float
    wait_s: float
    #: ``theta_pulled - theta_local`` of the parameters, whole (``None`` when streamed or no steps were taken).
    pseudo_gradient: Tensor | None = None
    #: The worker's serialized inner optimizer state (uint8), if sent.
    inner_state: Tensor | None = None
    #: The worker's floating-point buffer values (flat), if sent and the model has any.
    buffers: Tensor | None = None
    #: Bytes of the payload as it travelled (the encoded pseudo-gradient's fragments and the buffer values).
    payload_bytes: int = 0
    #: Why the outer side rejected the push (``None``: applied, or not looked at yet).
    rejected: str | None = None
    #: Steps of the worker's round still to come before it merges the reply (:attr:`WorkerHeader.pending`).
    pending: int = 0
    #: Which fragments it carries (:attr:`WorkerHeader.part`).
    part: int = -1

    @classmethod
    def of(cls, worker: int, header: WorkerHeader, buffers: Tensor | None = None,
           inner_state: Tensor | None = None, gradient_bytes: int = 0) -> Push:
        """The push a header announces (``gradient_bytes``: what its fragments weigh on the wire)."""
        payload = (gradient_bytes + (0 if buffers is None else 4 * buffers.numel())) if header.steps > 0 else 0
        return cls(worker, header.kind, header.steps, header.compute_s, header.wait_s, None, inner_state, buffers,
                   payload, pending=header.pending, part=header.part)


@dataclass(frozen=True)
class Fragment:
    """One fragment of the flat parameter vector: values ``[start, start + numel)``, made of pieces of these
    shapes (whole parameters, or row blocks / chunks of one larger than a fragment)."""

    start: int
    shapes: tuple[torch.Size, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def end(self) -> int:
        return self.start + self.numel


def _pieces(shape: torch.Size, max_values: int) -> list[torch.Size]:
    """``shape`` cut into pieces of at most ``max_values`` values: row blocks of a tensor with two or more
    dimensions (at least one row each), chunks of a flat one (a multiple of the int8 codec's chunk, so that its
    scales are the same as the whole tensor's)."""
    n = shape.numel()
    if n <= max_values:
        return [shape]
    if len(shape) >= 2:
        rows = max(1, max_values // (n // shape[0]))
        return [torch.Size([min(rows, shape[0] - r), *shape[1:]]) for r in range(0, shape[0], rows)]
    chunk = max_values - max_values % DEFAULT_CHUNK if max_values >= DEFAULT_CHUNK else max_values
    return [torch.Size([min(chunk, n - r)]) for r in range(0, n, chunk)]


def fragment_layout(shapes: Sequence[torch.Size], max_values: int) -> list[Fragment]:
    """Consecutive pieces of the tensors of ``shapes`` (flat, in order) grouped into fragments of at most
    ``max_values`` values (a single row longer than that is a fragment by itself). Empty tensors take none."""
    if max_values < 1:
        raise ValueError(f"A fragment holds at least one value, got max_values={max_values}.")
    fragments: list[Fragment] = []
    pieces: list[torch.Size] = []
    start = size = 0
    for shape in shapes:
        for piece in _pieces(torch.Size(shape), max_values) if torch.Size(shape).numel() else []:
            if pieces and size + piece.numel() > max_values:
                fragments.append(Fragment(start, tuple(pieces)))
                start, pieces, size = start + size, [], 0
            pieces.append(piece)
            size += piece.numel()
    if pieces:
        fragments.append(Fragment(start, tuple(pieces)))
    return fragments


def stagger_parts(fragments: Sequence[Fragment], parts: int) -> list[range]:
    """The fragments' indices cut into ``parts`` runs of consecutive fragments, each fragment in the part its middle
    value falls in when the values are cut into ``parts`` equal stretches (Streaming DiLoCo's fragments, synchronised
    at staggered steps: :mod:`.overlap`). A part left without a fragment (a tensor row longer than a part) is refused.
    """
    total = fragments[-1].end if fragments else 0
    owners = [min(parts - 1, (f.start + f.end) * parts // (2 * total)) for f in fragments]
    runs = [range(bisect.bisect_left(owners, p), bisect.bisect_right(owners, p)) for p in range(parts)]
    if parts > 1 and not all(runs):
        raise ValueError(f"`stagger={parts}` leaves a part of this model without parameters (its {total} values come"
                         f" in {len(fragments)} fragment(s) of whole tensor rows); use a smaller `stagger`.")
    return runs


class Fragments:
    """How a model's flat parameters travel: the :func:`fragment_layout` and one codec per fragment.

    Args:
        shapes: the parameters' shapes, in order.
        compression: the pseudo-gradients' codec (an object or a preset name: :func:`~.codecs.codec_from`).
        max_bytes: the largest fragment, in bytes of ``float32`` values.
        pull_compression: the pulled global parameters' codec: the parameters themselves, or, a codec that
            ``sends_changes``, changes of the public model (the parameters themselves in ``float32`` when a worker
            holds no logged version).
        parts: the fragments are grouped into this many parts (:func:`stagger_parts`; fragments are then at most
            a quarter of a part's share of the values), each of which a push may carry alone.
        forward: with a sparse pull codec, the codec of a round change that forwards the pushes of a fragment's
            push codec (SparseLoCo's :meth:`~..outer.sparseloco.SparseLoCo.round_codec`); ``None``: a change is the
            pull codec's encoding of the difference.
    """

    def __init__(self, shapes: Sequence[torch.Size], compression: Codec | str = NoCodec(),
                 max_bytes: int = FRAGMENT_BYTES, pull_compression: Codec | str = NoCodec(), parts: int = 1,
                 forward: Callable[[Codec], Any] | None = None) -> None:
        max_values = max(1, max_bytes // 4)
        if parts > 1:
            # fragments of at most a quarter of a part: the parts, whole fragments, come out within ~1/8 of equal
            max_values = min(max_values, max(1, -(-sum(torch.Size(s).numel() for s in shapes) // (4 * parts))))
        self.fragments = fragment_layout(shapes, max_values)
        #: The fragments' indices, part by part (one part: all of them).
        self.parts = stagger_parts(self.fragments, parts)
        push, pull = codec_from(compression), codec_from(pull_compression, "pull_compression")
        self.codecs = [push.bind(f.shapes) for f in self.fragments]
        self.pull_codecs = [(NoCodec() if pull.sends_changes else pull).bind(f.shapes) for f in self.fragments]
        #: The codecs of a public model's changes, one per fragment (empty: pulls send the parameters).
        self.delta_codecs: list[Any] = [pull.bind(f.shapes) for f in self.fragments] if pull.sends_changes else []
        #: The same, when they are round changes that forward the pushes (SparseLoCo's; else empty).
        self.round_codecs: list[Any] = []
        if forward is not None and self.delta_codecs and self.delta_codecs[0].sparse is not None:
            self.round_codecs = [forward(codec) for codec in self.codecs]
            self.delta_codecs = list(self.round_codecs)
        self.numel = sum(f.numel for f in self.fragments)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` of each fragment in the flat vector."""
        return [(f.start, f.end) for f in self.fragments]

    def indices(self, part: int = -1) -> range:
        """The indices of the fragments a message of ``part`` carries (``-1``: all)."""
        return range(len(self.fragments)) if part < 0 else self.parts[part]

    def span(self, part: int = -1) -> tuple[int, int]:
        """``(start, end)`` of ``part``'s values in the flat vector (its fragments are consecutive)."""
        chosen = self.indices(part)
        return (self.fragments[chosen[0]].start, self.fragments[chosen[-1]].end) if chosen else (0, 0)

    def part_nbytes(self, part: int = -1) -> int:
        """Bytes of one encoded pseudo-gradient of ``part`` (``-1``: all fragments)."""
        return sum(self.codecs[i].nbytes for i in self.indices(part))

    @property
    def nbytes(self) -> int:
        """Bytes of one encoded pseudo-gradient (all fragments)."""
        return self.part_nbytes()

    @property
    def pull_nbytes(self) -> int:
        """Bytes of one pulled set of global parameters (all fragments)."""
        return sum(c.nbytes for c in self.pull_codecs)

    def reply_nbytes(self, deltas: int, part: int = -1, rejected: int | None = None) -> int:
        """Bytes of the parameters' part of a reply whose header says ``deltas`` (:attr:`ServerHeader.deltas`),
        ``part`` and ``rejected`` (``None``: whole changes, as logged; see :meth:`skips_own`)."""
        if deltas >= 0:
            nbytes = deltas * sum(c.nbytes for c in self.delta_codecs)
            if rejected is not None and self.skips_own(deltas, rejected):
                nbytes -= sum(c.slot_bytes for c in self.round_codecs)
            return nbytes
        return sum(self.pull_codecs[i].nbytes for i in self.indices(part))

    def skips_own(self, deltas: int, rejected: int) -> bool:
        """Whether a reply's newest change travels without the receiving worker's slot: the changes forward the
        rounds' pushes, and the worker's push was applied (``rejected == 0``), so that change (this batch's) holds
        it and the worker has its bytes."""
        return bool(self.round_codecs) and deltas > 0 and rejected == 0

    def without_own(self, changes: list[Tensor], worker: int) -> list[Tensor]:
        """A reply's changes (one message per fragment each, oldest first) with ``worker``'s slot left out of the
        newest (:meth:`skips_own`): what travels to ``worker``."""
        n = len(self.round_codecs)
        return changes[:-n] + [p for c, m in zip(self.round_codecs, changes[-n:]) for p in c.around(m, worker)]

    def pull_buffer(self) -> Tensor:
        """A buffer for one encoded pull fragment or change (empty when pulls are not encoded: they travel as
        views)."""
        encoded = [c.nbytes for c in self.pull_codecs + self.delta_codecs if not c.raw]
        return torch.empty(max(encoded, default=0), dtype=torch.uint8)

    @property
    def largest(self) -> int:
        """Values in the largest fragment (the size of a fragment buffer)."""
        return max((f.numel for f in self.fragments), default=0)

    def split(self, flat: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Views of ``flat``, one per fragment (of ``part``), in order (no copies)."""
        if flat.numel() < self.numel:
            raise ValueError(f"Expected at least {self.numel} values, got {flat.numel()}.")
        return (flat[self.fragments[i].start : self.fragments[i].end] for i in self.indices(part))

    def _pull_codecs(self, part: int) -> list[Codec]:
        return [self.pull_codecs[i] for i in self.indices(part)]

    def encode(self, flat: Tensor) -> Iterator[Tensor]:
        """Each fragment of ``flat`` encoded by its codec, in order (no error feedback)."""
        return (codec.encode(part) for codec, part in zip(self.codecs, self.split(flat)))

    def encode_pull(self, params: Tensor, buffer: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Each fragment (of ``part``) of the global ``params`` encoded by its pull codec, in order: the ``float32``
        views of ``params`` themselves (a raw codec), or messages written into ``buffer`` (:meth:`pull_buffer`,
        reused: send each before the next)."""
        for codec, values in zip(self._pull_codecs(part), self.split(params, part)):
            yield values if codec.raw else codec.encode(values, buffer[: codec.nbytes])

    def pull_into(self, params: Tensor, into: Tensor, buffer: Tensor, part: int = -1) -> None:
        """What a pull of ``params`` (its ``part``) leaves a worker with, written into ``into`` (rank 0's own
        worker, which needs no bytes to travel, still gets the same values as the others)."""
        for codec, message, values in zip(self._pull_codecs(part), self.encode_pull(params, buffer, part),
                                          self.split(into, part)):
            values.copy_(message) if codec.raw else codec.decode(message, values)

    def pull_values(self, params: Tensor, buffer: Tensor, out: Tensor,
                    part: int = -1) -> Iterator[tuple[int, Tensor]]:
        """Each fragment (of ``part``) of the global ``params`` as a pull leaves a worker with it, with its first
        value's index: a view of ``params`` (a raw codec), or decoded into ``out`` (reused: consume each before the
        next)."""
        for i, message in zip(self.indices(part), self.encode_pull(params, buffer, part)):
            codec = self.pull_codecs[i]
            values = message if codec.raw else codec.decode(message, out[: codec.numel])
            yield self.fragments[i].start, values

    def decode(self, messages: Iterable[Tensor], out: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Each arriving fragment message (of ``part``) decoded into ``out`` (a buffer of at least :attr:`largest`
        values, reused for every fragment: consume each before the next), in order. The receiver checks the
        count."""
        for i, message in zip(self.indices(part), messages):
            codec = self.codecs[i]
            yield codec.read(message, out)

    def join(self, messages: Iterable[Tensor]) -> Tensor:
        """The whole decoded vector (reassembly, for tests and small models)."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for (s, e), codec, message in zip(self.ranges, self.codecs, messages):
            codec.decode(message, flat[s:e])
        return flat
