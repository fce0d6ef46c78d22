"""Pseudo-gradient codecs: fewer bytes per push.

A push carries the pseudo-gradient ``theta_pulled - theta_local`` of the parameters as one flat ``float32``
vector. A codec turns it into a flat ``uint8`` message of a size fixed by the model's layout (so the receiver can
allocate it before the bytes arrive) and back:

* ``"none"``: the ``float32`` values themselves (4 bytes per value, the bytes of the vector, no copy);
* ``"bf16"``: rounded to bfloat16, nearest-even (2 bytes per value); exact for bfloat16-representable values;
* ``"int8"``: symmetric 8-bit with one ``float32`` scale ``absmax / 127`` per row (as torchft's DiLoCo and
  Streaming DiLoCo, arXiv 2501.18512, quantize outer gradients row-wise). A row is the last dimensions of a
  tensor with two or more dimensions (``shape[0]`` rows), and a chunk of ``chunk`` values of a flat one (biases,
  norms). Each value is off by at most half its row's scale, ``absmax / 254``.
* ``"topk2"`` / ``"topk4"``: sparse and low-bit, after SparseLoCo (arXiv 2508.15706): the vector is cut into chunks
  of :data:`SPARSE_CHUNK` values, each sends its ``1 /`` :data:`SPARSE_KEEP` largest-magnitude values (at least
  one) as 16-bit positions within the chunk and 2- or 4-bit levels of one ``float32`` scale per chunk; the rest is
  zero. About 0.28 (``topk2``) or 0.31 (``topk4``) bytes per 8 values: 110x / 100x fewer bytes than ``"none"``.
  Only with error feedback is nothing lost for good (the values not sent wait in the residual).

:class:`ErrorFeedback` keeps what the codec lost (``residual = sent - decoded``) on the worker and adds it to
the next push, so that nothing is lost for good: the decoded pushes sum to the true ones minus the current
residual. Pure tensor code: no Lightning, no process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional

import torch
from torch import Tensor

from lightning_hdet._checks import check_bool, check_choice, check_int, check_number, require

CodecName = Literal["none", "bf16", "int8", "topk2", "topk4"]
CODECS: tuple[str, ...] = ("none", "bf16", "int8", "topk2", "topk4")
#: Values per chunk of the sparse codecs (a position within a chunk fits 16 bits).
SPARSE_CHUNK = 4096
#: The sparse codecs keep one value in this many of each chunk (1.6 %; SparseLoCo keeps 1-3 %).
SPARSE_KEEP = 64
#: Codecs for the pulled global parameters. ``"none"`` / ``"bf16"`` send the model itself, ``"int8"`` only its
#: change since the worker's last pull (:mod:`.public_model`): int8 of the weights themselves would err by up to
#: ``absmax / 254`` per row for good, int8 of a change errs only until the next pull carries the rest. The sparse
#: ones only with ``outer="sparseloco"``, whose changes are exactly sparse: a pull forwards the rounds' pushes as
#: they are (:mod:`.sparse_outer`). Under a dense outer step the public model fell behind the global one (the
#: research log's "Delta pulls").
PULL_CODECS: tuple[str, ...] = ("none", "bf16", "int8", "topk2", "topk4")
#: The codecs a pull can send changes in (:mod:`.public_model` works with any codec that loses values).
DELTA_PULL_CODECS: tuple[str, ...] = ("int8", "topk2", "topk4")
#: Values per int8 scale for flat (0-D / 1-D) tensors: 4 bytes of scale per 256 values (1.6 %).
DEFAULT_CHUNK = 256
_SCALE_BYTES = 4  # one float32 per row


def check_compression(compression: object, error_feedback: object, pull_compression: object = "none",
                      sparse_outer: bool = False) -> bool:
    """The strategy's ``compression`` / ``error_feedback`` / ``pull_compression`` arguments (raises the package's
    ``ValueError``); returns whether error feedback is in force. ``error_feedback=None``: on with every codec that
    loses values; given with ``compression="none"``, which loses nothing, it is refused (it would do nothing).
    ``sparse_outer``: the outer update is SparseLoCo's (``outer="sparseloco"``), the only one sparse pulls follow."""
    check_choice("compression", compression, CODECS,
                 hint="'bf16' halves a push, 'int8' quarters it (plus one float32 scale per row), 'topk2' / 'topk4'"
                      " send 1.6 % of the values in 2 / 4 bits (about 110x / 100x fewer bytes).")
    check_choice("pull_compression", pull_compression, PULL_CODECS,
                 hint="'bf16' halves a pull; 'int8' sends only what changed since the worker's last pull, the rest"
                      " following in later pulls; 'topk2' / 'topk4' only with outer='sparseloco'.")
    if str(pull_compression).startswith("topk"):
        require("pull_compression", pull_compression, sparse_outer, "'none', 'bf16' or 'int8' without"
                " outer='sparseloco'", "Under a dense outer step every value changes each round, so sparse changes"
                " let the workers' model fall behind the global one (the char LM's loss rose after 650 steps); with"
                " outer='sparseloco' the change is exactly sparse and a pull forwards the round's pushes.")
        require("pull_compression", pull_compression, pull_compression == compression,
                f"compression={compression!r} (a pull forwards the round's pushes as they are)",
                "Give both the same sparse codec.")
    if error_feedback is None:
        return compression != "none"
    check_bool("error_feedback", error_feedback)
    require("error_feedback", error_feedback, compression != "none", "left unset with compression='none'",
            "Float32 pushes lose nothing, so there is nothing to feed back; set `compression` or drop the argument.")
    require("error_feedback", error_feedback, error_feedback or not str(compression).startswith("topk"),
            f"True with compression={compression!r}",
            "A sparse codec drops 98 % of each push; without error feedback those values are lost for good.")
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


class Codec:
    """Encode a flat ``float32`` vector of a fixed layout into a flat ``uint8`` message of :attr:`nbytes` bytes.

    Args:
        name: ``"none"``, ``"bf16"`` or ``"int8"``.
        shapes: the shapes of the tensors the vector concatenates (the model's parameters, in order).
        chunk: int8 only: values per scale of flat tensors.
    """

    def __init__(self, name: CodecName, shapes: Sequence[torch.Size], chunk: int = DEFAULT_CHUNK) -> None:
        check_choice("compression", name, CODECS)
        self.name = name
        self.numel = sum(torch.Size(s).numel() for s in shapes)
        self.segments = row_layout(shapes, chunk) if name == "int8" else []
        self.rows = sum(rows for _, rows, _ in self.segments)
        self.sparse = SparseLayout(self.numel, int(name[4:])) if name.startswith("topk") else None

    @property
    def nbytes(self) -> int:
        """The size of every message: what one push of the vector costs on the wire."""
        if self.name == "none":
            return 4 * self.numel
        if self.name == "bf16":
            return 2 * self.numel
        if self.sparse is not None:
            return self.sparse.nbytes
        return _SCALE_BYTES * self.rows + self.numel

    @torch.no_grad()
    def encode(self, flat: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The message for ``flat`` (``float32``, on the host). ``"none"`` returns a view of ``flat`` itself."""
        if flat.numel() != self.numel or flat.dtype != torch.float32:
            raise ValueError(f"The codec expects {self.numel} float32 values, got {flat.numel()} {flat.dtype}.")
        if self.name == "none":
            return flat.contiguous().view(torch.uint8)
        if out is None:
            out = torch.empty(self.nbytes, dtype=torch.uint8)
        if self.name == "bf16":
            out.view(torch.bfloat16).copy_(flat)
            return out
        if self.sparse is not None:
            return self.sparse.encode(flat, out)
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

    @torch.no_grad()
    def decode(self, message: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The ``float32`` vector a message stands for (written into ``out`` when given; ``"none"`` without ``out``
        returns a view of the message itself)."""
        if message.numel() != self.nbytes or message.dtype != torch.uint8:
            raise ValueError(f"A {self.name!r} message has {self.nbytes} bytes, got {message.numel()} {message.dtype}.")
        if self.name == "none":
            return message.view(torch.float32) if out is None else out.copy_(message.view(torch.float32))
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32)
        if self.name == "bf16":
            return out.copy_(message.view(torch.bfloat16))
        if self.sparse is not None:
            return self.sparse.decode(message, out)
        scales, values = self._views(message)
        out.copy_(values)
        row = 0
        for offset, rows, length in self.segments:
            out[offset : offset + rows * length].view(rows, length).mul_(scales[row : row + rows].unsqueeze(1))
            row += rows
        return out

    def _views(self, message: Tensor) -> tuple[Tensor, Tensor]:
        """int8 layout: the float32 scales first (so they stay 4-byte aligned), then one int8 per value."""
        split = _SCALE_BYTES * self.rows
        return message[:split].view(torch.float32), message[split:].view(torch.int8)


class SparseLayout:
    """The sparse codecs' message for ``numel`` values: chunks of :data:`SPARSE_CHUNK` values (the last shorter),
    ``k = max(1, length // SPARSE_KEEP)`` kept per chunk. The message holds every chunk's ``float32`` scale, then
    every kept value's ``int16`` position within its chunk, then the kept values' ``bits``-bit levels, packed.

    A level ``q`` in ``[0, 2**bits)`` stands for ``(q - (2**bits - 1) / 2) * scale`` with ``scale = absmax /
    ((2**bits - 1) / 2)``: symmetric levels without zero (a kept value is a large one), the largest exact.
    """

    def __init__(self, numel: int, bits: int) -> None:
        self.numel, self.bits = numel, bits
        self.half = (2**bits - 1) / 2
        self.chunks = [(start, min(SPARSE_CHUNK, numel - start)) for start in range(0, numel, SPARSE_CHUNK)]
        self.keep = [max(1, length // SPARSE_KEEP) for _, length in self.chunks]
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
    ``residual = g + residual - decoded`` for the next one (zero for ``"none"``, which loses nothing). A push that
    travels in fragments encodes each with its own codec and the matching slice of the residual
    (:meth:`encode_part`). With ``decay`` below 1 each push sends ``codec(g + decay * residual)`` instead:
    SparseLoCo's accumulator, which stands in for the outer momentum (``outer="sparseloco"``).

    Args:
        codec: the whole push's codec (its name and size).
        enabled: False sends ``codec(g)`` and keeps no residual.
        decay: ``beta`` in [0, 1], the residual's weight in the next push (1: plain error feedback).
    """

    def __init__(self, codec: Codec, enabled: bool = True, decay: float = 1.0) -> None:
        check_number("error_decay", decay, 0.0, 1.0)
        self.codec, self.decay = codec, decay
        self.enabled = enabled and codec.name != "none"
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
