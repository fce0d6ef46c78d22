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

:class:`ErrorFeedback` keeps what the codec lost (``residual = sent - decoded``) on the worker and adds it to
the next push, so that nothing is lost for good: the decoded pushes sum to the true ones minus the current
residual. Pure tensor code: no Lightning, no process groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional

import torch
from torch import Tensor

from lightning_hdet._checks import check_bool, check_choice, check_int

CodecName = Literal["none", "bf16", "int8"]
CODECS: tuple[str, ...] = ("none", "bf16", "int8")
#: Codecs for the pulled global parameters: int8's error (up to ``absmax / 254`` per row) would be an error in the
#: weights themselves, not in one update of them.
PULL_CODECS: tuple[str, ...] = ("none", "bf16")
#: Values per int8 scale for flat (0-D / 1-D) tensors: 4 bytes of scale per 256 values (1.6 %).
DEFAULT_CHUNK = 256
_SCALE_BYTES = 4  # one float32 per row


def check_compression(compression: object, error_feedback: object, pull_compression: object = "none") -> None:
    """The strategy's ``compression`` / ``error_feedback`` / ``pull_compression`` arguments (raises the package's
    ``ValueError``)."""
    check_choice("compression", compression, CODECS,
                 hint="'bf16' halves a push, 'int8' quarters it (plus one float32 scale per row).")
    check_bool("error_feedback", error_feedback)
    check_choice("pull_compression", pull_compression, PULL_CODECS,
                 hint="'bf16' halves a pull; 8-bit weights would lose too much of the model itself.")


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

    @property
    def nbytes(self) -> int:
        """The size of every message: what one push of the vector costs on the wire."""
        if self.name == "none":
            return 4 * self.numel
        if self.name == "bf16":
            return 2 * self.numel
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


class ErrorFeedback:
    """A worker's codec with error feedback: each push sends ``codec(g + residual)`` and keeps
    ``residual = g + residual - decoded`` for the next one (zero for ``"none"``, which loses nothing). A push that
    travels in fragments encodes each with its own codec and the matching slice of the residual
    (:meth:`encode_part`).

    Args:
        codec: the whole push's codec (its name and size).
        enabled: False sends ``codec(g)`` and keeps no residual.
    """

    def __init__(self, codec: Codec, enabled: bool = True) -> None:
        self.codec = codec
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
