"""The exchange's wire format, as code (pure). Model-sized vectors travel in fragments of at most
:data:`FRAGMENT_BYTES` (:class:`Fragments`), so rank 0 applies each as it arrives.

Worker -> server: a :class:`WorkerHeader`; if ``steps > 0`` the float buffers' values; the serialized inner optimizer
state if any; if ``steps > 0`` the pseudo-gradient's fragments of ``part``, each in its codec. Server -> worker: a
:class:`ServerHeader`; unless it says stop, the global parameters of ``part`` in the pull codec or (``deltas = n``)
the public model's last ``n`` changes (:mod:`~..exchange.public_model`), then the global buffers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
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
    """What a worker's message means: its first (asks for the model), a round's end, or leaving (no reply)."""

    HELLO = 0
    PUSH = 1
    BYE = 2


class _Header:
    """A header: its fields as one ``float64`` tensor, in order (integers exact up to 2**53)."""

    SIZE: ClassVar[int]

    def encode(self) -> Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def receive(cls, recv: Callable[[Tensor], None]) -> Any:
        """The header ``recv`` fills in."""
        raw = torch.empty(cls.SIZE, dtype=torch.float64)
        recv(raw)
        return cls.decode(raw)

    @classmethod
    def decode(cls, tensor: Tensor) -> Any:
        if tensor.dtype != torch.float64 or tensor.numel() != cls.SIZE:
            name = f"{cls.__name__[:-len('Header')].lower()} header"
            raise ValueError(f"A {name} is float64[{cls.SIZE}], got {tensor.dtype}[{tensor.numel()}].")
        kinds = {"Kind": lambda v: Kind(int(v)), "int": int, "float": float}
        return cls(*(kinds[str(f.type)](v) for f, v in zip(fields(cls), tensor.tolist())))


@dataclass(frozen=True)
class WorkerHeader(_Header):
    """The header of a worker's message (``float64[7]``, fields in this order). ``compute_s``: the round's
    seconds; ``wait_s``: the previous exchange's; ``pending``: steps of this round after the push (overlap), in
    the next push; ``part``: ``-1`` all fragments, ``p`` those of a staggered part (the reply carries the same)."""

    kind: Kind
    steps: int
    compute_s: float
    wait_s: float
    inner_state_bytes: int = 0
    pending: int = 0
    part: int = -1

    SIZE: ClassVar[int] = 7


@dataclass(frozen=True)
class ServerHeader(_Header):
    """The header of the server's reply (``float64[6]``, fields in this order). ``next_local_steps``: 0 means stop;
    ``outer_updates``: the version that follows; ``rejected``: the worker's rejected pushes in a row; ``deltas``:
    ``-1`` the parameters follow, ``n`` the public model's last ``n`` changes; ``checkpoints``: rank 0's checkpoint
    requests so far (:mod:`~..lightning.checkpoints`)."""

    next_local_steps: int
    outer_updates: int
    rejected: int = 0
    deltas: int = -1
    part: int = -1
    checkpoints: int = 0

    SIZE: ClassVar[int] = 6


@dataclass
class Push:
    """A worker's message as the server sees it once its header, buffers and inner state arrived (the fragments
    stream; ``pseudo_gradient`` only where a whole push is held)."""

    worker: int
    kind: Kind
    steps: int
    compute_s: float
    wait_s: float
    pseudo_gradient: Tensor | None = None
    inner_state: Tensor | None = None
    buffers: Tensor | None = None
    payload_bytes: int = 0
    rejected: str | None = None
    pending: int = 0
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
    """Values ``[start, start + numel)`` of the flat parameters: pieces of these shapes (parameters or row blocks)."""

    start: int
    shapes: tuple[torch.Size, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def end(self) -> int:
        return self.start + self.numel


def _pieces(shape: torch.Size, max_values: int) -> list[torch.Size]:
    """``shape`` in pieces of at most ``max_values``: row blocks, or chunks of a multiple of the int8 chunk."""
    n = shape.numel()
    if n <= max_values:
        return [shape]
    if len(shape) >= 2:
        rows = max(1, max_values // (n // shape[0]))
        return [torch.Size([min(rows, shape[0] - r), *shape[1:]]) for r in range(0, shape[0], rows)]
    chunk = max_values - max_values % DEFAULT_CHUNK if max_values >= DEFAULT_CHUNK else max_values
    return [torch.Size([min(chunk, n - r)]) for r in range(0, n, chunk)]


def fragment_layout(shapes: Sequence[torch.Size], max_values: int) -> list[Fragment]:
    """The pieces of ``shapes``, in order, grouped into fragments of at most ``max_values`` (a longer row alone)."""
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
    """The fragments' indices in ``parts`` runs of about equal values (Streaming DiLoCo's parts)."""
    total = fragments[-1].end if fragments else 0
    owners = [min(parts - 1, (f.start + f.end) * parts // (2 * total)) for f in fragments]
    runs = [range(bisect.bisect_left(owners, p), bisect.bisect_right(owners, p)) for p in range(parts)]
    if parts > 1 and not all(runs):
        raise ValueError(f"`stagger={parts}` leaves a part of this model without parameters (its {total} values come"
                         f" in {len(fragments)} fragment(s) of whole tensor rows); use a smaller `stagger`.")
    return runs


class Fragments:
    """How a model's flat parameters travel: the :func:`fragment_layout` and each fragment's push, pull and delta
    codecs. ``parts``: staggered parts (:func:`stagger_parts`); ``forward``: with a sparse pull codec, the round
    change codec of a push codec (SparseLoCo's), which the changes then are."""

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
        self.delta_codecs: list[Any] = [pull.bind(f.shapes) for f in self.fragments] if pull.sends_changes else []
        self.round_codecs: list[Any] = []
        if forward is not None and self.delta_codecs and self.delta_codecs[0].sparse is not None:
            self.round_codecs = [forward(codec) for codec in self.codecs]
            self.delta_codecs = list(self.round_codecs)
        self.numel = sum(f.numel for f in self.fragments)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(f.start, f.end) for f in self.fragments]

    def indices(self, part: int = -1) -> range:
        """The indices of the fragments a message of ``part`` carries (``-1``: all)."""
        return range(len(self.fragments)) if part < 0 else self.parts[part]

    def span(self, part: int = -1) -> tuple[int, int]:
        """``(start, end)`` of ``part``'s values in the flat vector (its fragments are consecutive)."""
        chosen = self.indices(part)
        return (self.fragments[chosen[0]].start, self.fragments[chosen[-1]].end) if chosen else (0, 0)

    def part_nbytes(self, part: int = -1) -> int:
        return sum(self.codecs[i].nbytes for i in self.indices(part))

    @property
    def nbytes(self) -> int:
        return self.part_nbytes()

    @property
    def pull_nbytes(self) -> int:
        return sum(c.nbytes for c in self.pull_codecs)

    def reply_nbytes(self, deltas: int, part: int = -1, rejected: int | None = None) -> int:
        """Bytes of a reply's parameters for its header's ``deltas``, ``part``, ``rejected`` (``None``: as logged)."""
        if deltas >= 0:
            nbytes = deltas * sum(c.nbytes for c in self.delta_codecs)
            if rejected is not None and self.skips_own(deltas, rejected):
                nbytes -= sum(c.slot_bytes for c in self.round_codecs)
            return nbytes
        return sum(self.pull_codecs[i].nbytes for i in self.indices(part))

    def skips_own(self, deltas: int, rejected: int) -> bool:
        """Whether a reply's newest change leaves out the worker's slot (a forwarded round holding its push)."""
        return bool(self.round_codecs) and deltas > 0 and rejected == 0

    def without_own(self, changes: list[Tensor], worker: int) -> list[Tensor]:
        """A reply's changes with ``worker``'s slot left out of the newest (:meth:`skips_own`)."""
        n = len(self.round_codecs)
        return changes[:-n] + [p for c, m in zip(self.round_codecs, changes[-n:]) for p in c.around(m, worker)]

    def pull_buffer(self) -> Tensor:
        """A buffer for one encoded pull fragment or change (empty when pulls travel as views)."""
        encoded = [c.nbytes for c in self.pull_codecs + self.delta_codecs if not c.raw]
        return torch.empty(max(encoded, default=0), dtype=torch.uint8)

    @property
    def largest(self) -> int:
        return max((f.numel for f in self.fragments), default=0)

    def split(self, flat: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Views of ``flat``, one per fragment (of ``part``), in order (no copies)."""
        if flat.numel() < self.numel:
            raise ValueError(f"Expected at least {self.numel} values, got {flat.numel()}.")
        return (flat[self.fragments[i].start : self.fragments[i].end] for i in self.indices(part))

    def _pull_codecs(self, part: int) -> list[Codec]:
        return [self.pull_codecs[i] for i in self.indices(part)]

    def encode(self, flat: Tensor) -> Iterator[Tensor]:
        """Each fragment of ``flat`` encoded, in order (no error feedback)."""
        return (codec.encode(part) for codec, part in zip(self.codecs, self.split(flat)))

    def encode_pull(self, params: Tensor, buffer: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Each fragment of ``params``'s ``part`` in its pull codec: views, or messages in ``buffer`` (reused)."""
        for codec, values in zip(self._pull_codecs(part), self.split(params, part)):
            yield values if codec.raw else codec.encode(values, buffer[: codec.nbytes])

    def pull_into(self, params: Tensor, into: Tensor, buffer: Tensor, part: int = -1) -> None:
        """What a pull of ``params`` leaves a worker with, into ``into`` (rank 0's worker gets what the others do)."""
        for codec, message, values in zip(self._pull_codecs(part), self.encode_pull(params, buffer, part),
                                          self.split(into, part)):
            values.copy_(message) if codec.raw else codec.decode(message, values)

    def pull_values(self, params: Tensor, buffer: Tensor, out: Tensor,
                    part: int = -1) -> Iterator[tuple[int, Tensor]]:
        """``(start, values)`` of each fragment of ``params`` as a pull leaves it: views, or decoded into ``out``."""
        for i, message in zip(self.indices(part), self.encode_pull(params, buffer, part)):
            codec = self.pull_codecs[i]
            values = message if codec.raw else codec.decode(message, out[: codec.numel])
            yield self.fragments[i].start, values

    def decode(self, messages: Iterable[Tensor], out: Tensor, part: int = -1) -> Iterator[Tensor]:
        """Each arriving message of ``part`` decoded into ``out`` (reused), or a view (raw codecs)."""
        for i, message in zip(self.indices(part), messages):
            codec = self.codecs[i]
            yield codec.decode(message, None if codec.raw else out[: codec.numel])

    def join(self, messages: Iterable[Tensor]) -> Tensor:
        """The whole decoded vector (reassembly, for tests and small models)."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        for (s, e), codec, message in zip(self.ranges, self.codecs, messages):
            codec.decode(message, flat[s:e])
        return flat
