"""Pseudo-gradient codecs: fewer bytes per push. Pure tensor code: no Lightning, no process groups.

A push carries the pseudo-gradient ``theta_pulled - theta_local`` of the parameters as one flat ``float32``
vector. A codec (one object: :class:`NoCodec`, :class:`BF16`, :class:`Int8`, :class:`TopK`) turns it into a flat
``uint8`` message of a size fixed by the model's layout (so the receiver can allocate it before the bytes arrive)
and back. ``compression="int8"`` and the other strings are presets (:data:`CODEC_PRESETS`, the one place a codec has
a name). A new codec is one subclass of :class:`Codec` (``nbytes``, ``_encode``, ``_decode``) plus its test.

:class:`ErrorFeedback` keeps what the codec lost (``residual = sent - decoded``) on the worker and adds it to
the next push, so that nothing is lost for good: the decoded pushes sum to the true ones minus the current
residual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_bool, check_choice, check_int, check_number, require

#: Values per chunk of the sparse codecs (a position within a chunk fits 16 bits).
SPARSE_CHUNK = 4096
#: Values per int8 scale for flat (0-D / 1-D) tensors: 4 bytes of scale per 256 values (1.6 %).
DEFAULT_CHUNK = 256
_SCALE_BYTES = 4  # one float32 per row


@dataclass(frozen=True)
class Codec(KnownArguments):
    """Base of the codecs: a frozen dataclass whose fields are its options (checked in ``__post_init__``), bound to a
    layout by :meth:`bind` (a copy that knows :attr:`numel`), with its own :attr:`nbytes`, :meth:`encode` and
    :meth:`decode`. What the exchange asks of a codec besides those:

    * ``raw``: its messages are the ``float32`` values' own bytes (views, nothing copied, nothing lost: no error
      feedback, and a pull lands straight in place);
    * ``sends_changes``: as ``pull_compression``, a pull sends the public model's changes since the worker's last
      pull in this codec (:mod:`~..exchange.public_model`) instead of the parameters themselves;
    * ``sparse``: once bound, the :class:`SparseLayout` of a codec whose messages add into a vector (``None``: not
      sparse), which SparseLoCo's round changes forward.
    """

    raw: ClassVar[bool] = False
    sends_changes: ClassVar[bool] = False
    numel: int = field(default=0, init=False, repr=False, compare=False)
    sparse: Optional[SparseLayout] = field(default=None, init=False, repr=False, compare=False)

    def bind(self, shapes: Sequence[torch.Size]) -> Codec:
        """This codec for the flat concatenation of tensors of ``shapes`` (a copy; ``self`` stays unbound)."""
        bound = replace(self)
        object.__setattr__(bound, "numel", sum(torch.Size(s).numel() for s in shapes))
        bound._layout(shapes)
        return bound

    def _layout(self, shapes: Sequence[torch.Size]) -> None:
        """What a codec keeps about its layout (set with ``object.__setattr__``: the object is frozen)."""

    @property
    def nbytes(self) -> int:
        """The size of every message: what one push of the vector costs on the wire."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The codec's name and options (the run config; :func:`codec_from` builds it back)."""
        return {"codec": type(self).__name__, **{f.name: getattr(self, f.name) for f in fields(self) if f.init}}

    @torch.no_grad()
    def encode(self, flat: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The message for ``flat`` (``float32``, on the host), written into ``out`` when given (a raw codec returns
        a view of ``flat`` itself)."""
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ValueError(f"The codec expects {self.numel} float32 values, got {flat.numel()} {flat.dtype}.")
        return self._encode(flat, torch.empty(self.nbytes, dtype=torch.uint8) if out is None and not self.raw else out)

    @torch.no_grad()
    def decode(self, message: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The ``float32`` vector a message stands for, written into ``out`` when given (a raw codec without ``out``
        returns a view of the message itself)."""
        if message.numel() != self.nbytes or message.dtype != torch.uint8:
            raise ValueError(f"A {self!r} message has {self.nbytes} bytes, got {message.numel()} {message.dtype}.")
        return self._decode(message, torch.empty(self.numel, dtype=torch.float32) if out is None and not self.raw
                            else out)

    def read(self, message: Tensor, scratch: Tensor) -> Tensor:
        """The values of ``message``: decoded into ``scratch`` (its first :attr:`numel`), or a view (raw)."""
        return self.decode(message, scratch[: self.numel])

    def _encode(self, flat: Tensor, out: Tensor) -> Tensor:
        raise NotImplementedError

    def _decode(self, message: Tensor, out: Tensor) -> Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class NoCodec(Codec):
    """The ``float32`` values themselves (4 bytes per value): the vector's own bytes, no copy."""

    raw: ClassVar[bool] = True

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    def read(self, message: Tensor, scratch: Tensor) -> Tensor:
        return self.decode(message)

    def _encode(self, flat: Tensor, out: Optional[Tensor]) -> Tensor:
        return flat.contiguous().view(torch.uint8)

    def _decode(self, message: Tensor, out: Optional[Tensor]) -> Tensor:
        return message.view(torch.float32) if out is None else out.copy_(message.view(torch.float32))


@dataclass(frozen=True)
class BF16(Codec):
    """Rounded to bfloat16, nearest-even (2 bytes per value); exact for bfloat16-representable values."""

    @property
    def nbytes(self) -> int:
        return 2 * self.numel

    def _encode(self, flat: Tensor, out: Tensor) -> Tensor:
        out.view(torch.bfloat16).copy_(flat)
        return out

    def _decode(self, message: Tensor, out: Tensor) -> Tensor:
        return out.copy_(message.view(torch.bfloat16))


@dataclass(frozen=True)
class Int8(Codec):
    """Symmetric 8-bit with one ``float32`` scale ``absmax / 127`` per row (as torchft's DiLoCo and Streaming
    DiLoCo, arXiv 2501.18512, quantize outer gradients row-wise). A row is the last dimensions of a tensor with two or
    more dimensions (``shape[0]`` rows), and a chunk of ``chunk`` values of a flat one (biases, norms). Each value is
    off by at most half its row's scale, ``absmax / 254``. As a pull codec it sends the public model's changes.

    Args:
        chunk: values per scale of flat tensors.
    """

    sends_changes: ClassVar[bool] = True
    chunk: int = DEFAULT_CHUNK
    segments: tuple[tuple[int, int, int], ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("chunk", self.chunk, minimum=1)

    def _layout(self, shapes: Sequence[torch.Size]) -> None:
        object.__setattr__(self, "segments", tuple(row_layout(shapes, self.chunk)))

    @property
    def nbytes(self) -> int:
        return _SCALE_BYTES * sum(rows for _, rows, _ in self.segments) + self.numel

    def _encode(self, flat: Tensor, out: Tensor) -> Tensor:
        scales, values = self._views(out)
        row = 0
        for offset, rows, length in self.segments:
            block = flat[offset : offset + rows * length].view(rows, length)
            scale = scales[row : row + rows]
            torch.amax(block.abs(), dim=1, out=scale)
            scale.div_(127.0)
            # an all-zero row has scale 0: divide by 1 instead (its values quantize to 0 either way)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
            values[offset : offset + rows * length].view(rows, length).copy_(
                torch.round(block / safe).clamp_(-127, 127))
            row += rows
        return out

    def _decode(self, message: Tensor, out: Tensor) -> Tensor:
        scales, values = self._views(message)
        out.copy_(values)
        row = 0
        for offset, rows, length in self.segments:
            out[offset : offset + rows * length].view(rows, length).mul_(scales[row : row + rows].unsqueeze(1))
            row += rows
        return out

    def _views(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """The float32 scales first (so they stay 4-byte aligned), then one int8 per value."""
        split = message.numel() - self.numel
        return message[:split].view(torch.float32), message[split:].view(torch.int8)


@dataclass(frozen=True)
class TopK(Codec):
    """Sparse and low-bit, after SparseLoCo (arXiv 2508.15706): the vector is cut into chunks of
    :data:`SPARSE_CHUNK` values, each sends its ``fraction`` largest-magnitude values (at least one) as 16-bit
    positions within the chunk and ``bits``-bit levels of one ``float32`` scale per chunk; the rest is zero. At the
    default fraction (1/64) about 0.28 (2 bits) or 0.31 (4 bits) bytes per 8 values: 110x / 100x fewer than float32.
    Only with error feedback is nothing lost for good (the values not sent wait in the residual). As a pull codec
    it sends changes, and only under SparseLoCo (:mod:`~..outer.sparseloco`), whose changes are exactly sparse.

    Args:
        fraction: the share of each chunk's values sent, in (0, 1].
        bits: bits per sent value's level: 1, 2, 4 or 8.
    """

    sends_changes: ClassVar[bool] = True
    fraction: float = 1 / 64
    bits: int = 2

    def __post_init__(self) -> None:
        check_number("fraction", self.fraction, 0.0, 1.0, low_open=True, hint="SparseLoCo keeps 1-3 % (1/64: 1.6 %).")
        check_choice("bits", self.bits, (1, 2, 4, 8))

    def _layout(self, shapes: Sequence[torch.Size]) -> None:
        object.__setattr__(self, "sparse", SparseLayout(self.numel, self.bits, self.fraction))

    @property
    def nbytes(self) -> int:
        assert self.sparse is not None, "bind() the codec to a layout first"
        return self.sparse.nbytes

    def _encode(self, flat: Tensor, out: Tensor) -> Tensor:
        assert self.sparse is not None
        return self.sparse.encode(flat, out)

    def _decode(self, message: Tensor, out: Tensor) -> Tensor:
        assert self.sparse is not None
        return self.sparse.decode(message, out)


#: The preset names of ``compression=`` / ``pull_compression=``: the only place a codec has a name.
CODEC_PRESETS: dict[str, Codec] = {"none": NoCodec(), "bf16": BF16(), "int8": Int8(), "topk2": TopK(bits=2),
                                   "topk4": TopK(bits=4)}
_CODEC_CLASSES = {cls.__name__: cls for cls in (NoCodec, BF16, Int8, TopK)}


def codec_from(value: Any, name: str = "compression") -> Codec:
    """A codec object from what a user gave ``name``: a :class:`Codec` (as it is), a preset name
    (:data:`CODEC_PRESETS`), or :meth:`Codec.options` (what an elastic service publishes)."""
    if isinstance(value, Codec):
        return value
    if isinstance(value, Mapping) and value.get("codec") in _CODEC_CLASSES:
        options = {k: v for k, v in value.items() if k != "codec"}
        return _CODEC_CLASSES[value["codec"]](**options)
    check_choice(name, value, tuple(CODEC_PRESETS), hint="Or a codec object: NoCodec(), BF16(), Int8(), TopK(fraction,"
                 " bits). 'bf16' halves a push, 'int8' quarters it, 'topk2' / 'topk4' send 1.6 % of the values.")
    return CODEC_PRESETS[value]


def check_codecs(push: Codec, pull: Codec, error_feedback: object, forwards_rounds: bool = False) -> bool:
    """The strategy's ``compression`` / ``pull_compression`` / ``error_feedback`` together (raises the package's
    ``ValueError``); returns whether error feedback is in force. ``error_feedback=None``: on with every codec that
    loses values; given with a raw codec, which loses nothing, it is refused (it would do nothing).
    ``forwards_rounds``: the outer update's changes are the rounds' sparse pushes (SparseLoCo), the only ones sparse
    pulls follow."""
    if pull.sends_changes and isinstance(pull, TopK):
        require("pull_compression", pull, forwards_rounds, "NoCodec(), BF16() or Int8() without SparseLoCo", "Under a"
                " dense outer step every value changes each round, so sparse changes let the workers' model fall"
                " behind the global one (the char LM's loss rose after 650 steps); with SparseLoCo the change is"
                " exactly sparse and a pull forwards the round's pushes.")
        require("pull_compression", pull, pull == push, f"compression={push!r} (a pull forwards the round's pushes"
                " as they are)", "Give both the same sparse codec.")
    if error_feedback is None:
        return not push.raw
    check_bool("error_feedback", error_feedback)
    require("error_feedback", error_feedback, not push.raw, f"left unset with compression={push!r}",
            "Float32 pushes lose nothing, so there is nothing to feed back; set `compression` or drop the argument.")
    require("error_feedback", error_feedback, error_feedback or push.sparse is None and not isinstance(push, TopK),
            f"True with compression={push!r}",
            "A sparse codec drops most of each push; without error feedback those values are lost for good.")
    return bool(error_feedback)


def row_layout(shapes: Sequence[torch.Size], chunk: int = DEFAULT_CHUNK) -> list[tuple[int, int, int]]:
    """``(offset, rows, row_length)`` segments covering the flat concatenation of tensors of ``shapes``: a tensor
    with two or more dimensions has ``shape[0]`` rows; a flat one is cut into chunks of ``chunk`` values (the last
    one shorter, as its own segment). Empty tensors take no segment."""
    check_int("chunk", chunk, minimum=1)
    segments = []
    offset = 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        if numel and len(shape) >= 2:
            segments.append((offset, shape[0], numel // shape[0]))
        elif numel:
            full, rest = divmod(numel, chunk)
            if full:
                segments.append((offset, full, chunk))
            if rest:
                segments.append((offset + full * chunk, 1, rest))
        offset += numel
    return segments


class SparseLayout:
    """The sparse codecs' message for ``numel`` values: chunks of :data:`SPARSE_CHUNK` values (the last shorter),
    ``k = max(1, floor(length * fraction))`` kept per chunk. The message holds every chunk's ``float32`` scale, then
    every kept value's ``int16`` position within its chunk, then the kept values' ``bits``-bit levels, packed.

    A level ``q`` in ``[0, 2**bits)`` stands for ``(q - (2**bits - 1) / 2) * scale`` with ``scale = absmax /
    ((2**bits - 1) / 2)``: symmetric levels without zero (a kept value is a large one), the largest exact.
    """

    def __init__(self, numel: int, bits: int, fraction: float = 1 / 64) -> None:
        self.numel, self.bits = numel, bits
        self.half = (2**bits - 1) / 2
        self.chunks = [(start, min(SPARSE_CHUNK, numel - start)) for start in range(0, numel, SPARSE_CHUNK)]
        self.keep = [max(1, math.floor(length * fraction + 1e-9)) for _, length in self.chunks]
        self.kept = sum(self.keep)
        self.per_byte = 8 // bits
        self._positions = _SCALE_BYTES * len(self.chunks)
        self._levels = self._positions + 2 * self.kept
        self.nbytes = self._levels + -(-self.kept // self.per_byte)

    def _views(self, message: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return (message[: self._positions].view(torch.float32),
                message[self._positions : self._levels].view(torch.int16), message[self._levels :])

    def _groups(self) -> list[tuple[int, int, int, int, int]]:
        """``(start, rows, length, k, offset)``: runs of equal chunks (all full ones, then the last) and where their
        kept values start in the message, so each run is one batched top-k."""
        full = sum(1 for _, length in self.chunks if length == SPARSE_CHUNK)
        groups = [(0, full, SPARSE_CHUNK, self.keep[0], 0)] if full else []
        if full < len(self.chunks):
            start, length = self.chunks[-1]
            groups.append((start, 1, length, self.keep[-1], full * (self.keep[0] if full else 0)))
        return groups

    @torch.no_grad()
    def encode(self, flat: Tensor, out: Tensor) -> Tensor:
        scales, positions, packed = self._views(out)
        levels = torch.empty(self.kept, dtype=torch.uint8)
        for index, (start, rows, length, k, offset) in enumerate(self._groups()):
            block = flat[start : start + rows * length].view(rows, length)
            top = torch.topk(block.abs(), k, dim=1, sorted=False).indices
            kept = torch.gather(block, 1, top)
            scale = kept.abs().amax(dim=1, keepdim=True) / self.half
            first = 0 if index == 0 else len(self.chunks) - 1
            scales[first : first + rows].copy_(scale.squeeze(1))
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero chunk sends level "half"
            level = torch.round(kept / safe + self.half).clamp_(0, 2 * self.half)
            positions[offset : offset + rows * k].copy_(top.reshape(-1))
            levels[offset : offset + rows * k].copy_(level.reshape(-1))
        packed.copy_(_pack(levels, self.bits, packed.numel()))
        return out

    @torch.no_grad()
    def decode(self, message: Tensor, out: Tensor) -> Tensor:
        out.zero_()
        return self.add_into(message, out)

    @torch.no_grad()
    def add_into(self, message: Tensor, out: Tensor) -> Tensor:
        """Add the values ``message`` stands for to ``out`` (one float32 addition per kept value, so that the sum
        of several messages is the same, bit for bit, wherever it is computed in the same order)."""
        scales, positions, packed = self._views(message)
        levels = _unpack(packed, self.bits, self.kept).to(torch.float32).sub_(self.half)
        for index, (start, rows, length, k, offset) in enumerate(self._groups()):
            first = 0 if index == 0 else len(self.chunks) - 1
            values = levels[offset : offset + rows * k].view(rows, k) * scales[first : first + rows].unsqueeze(1)
            # a chunk whose scale is 0 decodes to zeros whatever its levels say
            values = torch.where(scales[first : first + rows].unsqueeze(1) > 0, values, torch.zeros_like(values))
            where = positions[offset : offset + rows * k].view(rows, k).to(torch.int64)
            out[start : start + rows * length].view(rows, length).scatter_add_(1, where, values)
        return out


def _pack(levels: Tensor, bits: int, nbytes: int) -> Tensor:
    """``bits``-bit levels (``uint8``, each below ``2**bits``) packed ``8 // bits`` to a byte, low bits first."""
    per_byte = 8 // bits
    padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8)
    padded[: levels.numel()] = levels
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (padded.view(nbytes, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack(packed: Tensor, bits: int, count: int) -> Tensor:
    """The first ``count`` levels of :func:`_pack`'s bytes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    mask = (1 << bits) - 1
    return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:count]


class ErrorFeedback:
    """A worker's codec with error feedback: each push sends ``codec(g + residual)`` and keeps
    ``residual = g + residual - decoded`` for the next one (none for a raw codec, which loses nothing). A push that
    travels in fragments encodes each with its own codec and the matching slice of the residual
    (:meth:`encode_part`). With ``decay`` below 1 each push sends ``codec(g + decay * residual)`` instead:
    SparseLoCo's accumulator, which stands in for the outer momentum (:mod:`~..outer.sparseloco`).

    Args:
        codec: the whole push's codec, bound to the whole model (:meth:`Codec.bind`).
        enabled: False sends ``codec(g)`` and keeps no residual.
        decay: ``beta`` in [0, 1], the residual's weight in the next push (1: plain error feedback).
    """

    def __init__(self, codec: Codec, enabled: bool = True, decay: float = 1.0) -> None:
        check_number("error_decay", decay, 0.0, 1.0)
        self.codec, self.decay = codec, decay
        self.enabled = enabled and not codec.raw
        self.residual = torch.zeros(codec.numel if self.enabled else 0, dtype=torch.float32)
        self._decoded = torch.empty(0, dtype=torch.float32)

    def encode(self, pseudo_gradient: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The message for this push. Adds the residual to ``pseudo_gradient`` in place (the caller's push buffer,
        which is rebuilt every round) to avoid a model-sized temporary."""
        return self.encode_part(self.codec, pseudo_gradient, 0, out)

    @torch.no_grad()
    def encode_part(self, codec: Codec, values: Tensor, start: int, out: Optional[Tensor] = None) -> Tensor:
        """The message for the values ``[start, start + codec.numel)`` of this push (``values``, changed in
        place like :meth:`encode`), with that slice of the residual."""
        if not self.enabled:
            return codec.encode(values, out)
        residual = self.residual[start : start + codec.numel]
        if self.decay != 1.0:
            residual.mul_(self.decay)
        values.add_(residual)
        message = codec.encode(values, out)
        if self._decoded.numel() < codec.numel:
            self._decoded = torch.empty(codec.numel, dtype=torch.float32)
        torch.sub(values, codec.decode(message, self._decoded[: codec.numel]), out=residual)
        return message

    def state_dict(self) -> dict[str, Tensor]:
        return {"residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        residual = state["residual"]
        if residual.numel() == self.residual.numel():  # else: a run with another codec; start without one
            self.residual.copy_(residual)


def codec_numbers(name: str, codec: Codec) -> dict[str, Any]:
    """A codec's class and options under ``name`` (the run config: ``compression``, ``compression/bits``, ...)."""
    options = codec.options()
    return {name: options.pop("codec"), **{f"{name}/{k}": v for k, v in options.items()}}
