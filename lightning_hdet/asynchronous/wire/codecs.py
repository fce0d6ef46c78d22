"""Pseudo-gradient codecs (pure tensor code): a flat ``float32`` vector to a ``uint8`` message whose size the
layout fixes (the receiver allocates it before the bytes arrive), and back. Strings are presets
(:data:`CODEC_PRESETS`); a new codec is one subclass of :class:`Codec` plus its test. :class:`ErrorFeedback` adds
what the codec lost to the next push."""

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
    """Base of the codecs: a frozen dataclass of its options, bound to a layout by :meth:`bind`. ``raw``: messages
    are the values' own bytes (views, lossless); ``sends_changes``: as a pull codec it sends the public model's
    changes (:mod:`~..exchange.public_model`); ``sparse``: once bound, the :class:`SparseLayout` of a sparse codec."""

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
        """What a codec keeps about its layout (``object.__setattr__``: frozen)."""

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The codec's name and options (the run config; :func:`codec_from` builds it back)."""
        return {"codec": type(self).__name__, **{f.name: getattr(self, f.name) for f in fields(self) if f.init}}

    @torch.no_grad()
    def encode(self, flat: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The message for ``flat`` (``float32``, host), into ``out`` when given (raw: a view of ``flat``)."""
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ValueError(f"The codec expects {self.numel} float32 values, got {flat.numel()} {flat.dtype}.")
        return self._encode(flat, torch.empty(self.nbytes, dtype=torch.uint8) if out is None and not self.raw else out)

    @torch.no_grad()
    def decode(self, message: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The ``float32`` vector of a message, into ``out`` when given (raw without ``out``: a view)."""
        if message.numel() != self.nbytes or message.dtype != torch.uint8:
            raise ValueError(f"A {self!r} message has {self.nbytes} bytes, got {message.numel()} {message.dtype}.")
        return self._decode(message, torch.empty(self.numel, dtype=torch.float32) if out is None and not self.raw
                            else out)

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
    DiLoCo quantize row-wise); a flat tensor's rows are chunks of ``chunk`` values. As a pull codec: changes.

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
    """Sparse and low-bit, after SparseLoCo (arXiv 2508.15706): each chunk of :data:`SPARSE_CHUNK` values sends its
    ``fraction`` largest-magnitude values as 16-bit positions and ``bits``-bit levels of one scale (1/64, 2 bits:
    110x fewer bytes than float32). Needs error feedback; as a pull codec only under SparseLoCo.

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
        return self.sparse.encode(flat, out)  # type: ignore[union-attr]

    def _decode(self, message: Tensor, out: Tensor) -> Tensor:
        return self.sparse.decode(message, out)  # type: ignore[union-attr]


#: The preset names of ``compression=`` / ``pull_compression=``: the only place a codec has a name.
CODEC_PRESETS: dict[str, Codec] = {"none": NoCodec(), "bf16": BF16(), "int8": Int8(), "topk2": TopK(bits=2),
                                   "topk4": TopK(bits=4)}
_CODEC_CLASSES = {cls.__name__: cls for cls in (NoCodec, BF16, Int8, TopK)}


def codec_from(value: Any, name: str = "compression") -> Codec:
    """A codec object from a :class:`Codec`, a preset name or :meth:`Codec.options` (an elastic service's)."""
    if isinstance(value, Codec):
        return value
    if isinstance(value, Mapping) and value.get("codec") in _CODEC_CLASSES:
        options = {k: v for k, v in value.items() if k != "codec"}
        return _CODEC_CLASSES[value["codec"]](**options)
    check_choice(name, value, tuple(CODEC_PRESETS), hint="Or a codec object: NoCodec(), BF16(), Int8(), TopK(fraction,"
                 " bits). 'bf16' halves a push, 'int8' quarters it, 'topk2' / 'topk4' send 1.6 % of the values.")
    return CODEC_PRESETS[value]


def check_codecs(push: Codec, pull: Codec, error_feedback: object, forwards_rounds: bool = False) -> bool:
    """``compression`` / ``pull_compression`` / ``error_feedback`` together; returns whether error feedback is in
    force (``None``: on with every lossy codec). ``forwards_rounds``: SparseLoCo, the only step sparse pulls follow."""
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
    """``(offset, rows, row_length)`` over ``shapes``: ``shape[0]`` rows, or chunks of ``chunk`` values (>= 1)."""
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
    """The sparse message for ``numel`` values: per chunk ``k = max(1, floor(length * fraction))`` kept; every
    chunk's ``float32`` scale, every kept value's ``int16`` position, then the ``bits``-bit levels, packed. Level
    ``q`` stands for ``(q - half) * scale``, ``half = (2**bits - 1) / 2``: symmetric, no zero, the largest exact."""

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
        """``(start, rows, length, k, offset, first)``: runs of equal chunks, each one batched top-k (``first``: the
        run's first chunk)."""
        full = sum(1 for _, length in self.chunks if length == SPARSE_CHUNK)
        groups = [(0, full, SPARSE_CHUNK, self.keep[0], 0, 0)] if full else []
        if full < len(self.chunks):
            start, length = self.chunks[-1]
            groups.append((start, 1, length, self.keep[-1], full * (self.keep[0] if full else 0), len(self.chunks) - 1))
        return groups

    @torch.no_grad()
    def encode(self, flat: Tensor, out: Tensor) -> Tensor:
        scales, positions, packed = self._views(out)
        levels = torch.empty(self.kept, dtype=torch.uint8)
        for start, rows, length, k, offset, first in self._groups():
            block = flat[start : start + rows * length].view(rows, length)
            top = torch.topk(block.abs(), k, dim=1, sorted=False).indices
            kept = torch.gather(block, 1, top)
            scale = kept.abs().amax(dim=1, keepdim=True) / self.half
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
        """Add ``message``'s values to ``out``: one float32 addition each, the same sum wherever computed."""
        scales, positions, packed = self._views(message)
        levels = _unpack(packed, self.bits, self.kept).to(torch.float32).sub_(self.half)
        for start, rows, length, k, offset, first in self._groups():
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
    """A worker's ``codec`` (bound to the whole model) with error feedback: each push sends ``codec(g + decay *
    residual)`` and keeps ``residual = sent - decoded`` (none for a raw codec, or unless ``enabled``); ``decay < 1``
    is SparseLoCo's accumulator."""

    def __init__(self, codec: Codec, enabled: bool = True, decay: float = 1.0) -> None:
        check_number("error_decay", decay, 0.0, 1.0)
        self.codec, self.decay = codec, decay
        self.enabled = enabled and not codec.raw
        self.residual = torch.zeros(codec.numel if self.enabled else 0, dtype=torch.float32)
        self._decoded = torch.empty(0, dtype=torch.float32)

    def encode(self, pseudo_gradient: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The message for this push (``pseudo_gradient`` changed in place: no model-sized temporary)."""
        return self.encode_part(self.codec, pseudo_gradient, 0, out)

    @torch.no_grad()
    def encode_part(self, codec: Codec, values: Tensor, start: int, out: Optional[Tensor] = None) -> Tensor:
        """The message for values ``[start, start + codec.numel)`` of this push, with that slice of the residual."""
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
    """A codec's class and options under ``name`` (the run config)."""
    options = codec.options()
    return {name: options.pop("codec"), **{f"{name}/{k}": v for k, v in options.items()}}
