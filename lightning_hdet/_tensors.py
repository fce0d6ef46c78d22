"""One home for moving a model's state around as flat vectors: which tensors, flattening, writing back, and the
host copies (pinned when the device is CUDA, so device<->host copies can be asynchronous).

Both HDET (merges, roll-back backups) and asynchronous Local-SGD (pushes and pulls) carry "the parameters, then
the floating-point buffers" in a fixed order; integer buffers (counters) are never averaged and stay put.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module


def float_buffers(module: Module) -> list[Tensor]:
    """The floating-point buffers (e.g. BatchNorm statistics), in a fixed order."""
    return [b for b in module.buffers() if torch.is_floating_point(b)]


def model_state(module: Module) -> list[Tensor]:
    """What a merge or an exchange carries, in this order: the parameters, then the floating-point buffers."""
    return list(module.parameters()) + float_buffers(module)


def numel(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def flat_pieces(tensors: Sequence[Tensor], start: int, end: int) -> list[Tensor]:
    """Views of the values ``[start, end)`` of the tensors' flat concatenation (each tensor contiguous), in order:
    a fragment of a model read or written without flattening the whole of it."""
    pieces, offset = [], 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            pieces.append(t.detach().view(-1)[lo - offset : hi - offset])
        offset += n
    return pieces


def flat_dtype(tensors: Sequence[Tensor]) -> torch.dtype:
    """The dtype of the flat vectors that carry ``tensors``: float64 if any tensor is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """A new flat copy on the tensors' device, in :func:`flat_dtype`."""
    dtype = flat_dtype(tensors)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


@torch.no_grad()
def assign_flat(tensors: Sequence[Tensor], flat: Tensor, strength: float = 1.0) -> None:
    """Move each tensor toward its slice of ``flat``: ``t <- (1 - strength) * t + strength * slice``."""
    offset = 0
    for t in tensors:
        part = flat[offset : offset + t.numel()].view_as(t).to(t.device, t.dtype, non_blocking=True)
        offset += t.numel()
        if strength >= 1.0:
            t.copy_(part)
        elif strength > 0.0:
            t.lerp_(part, strength)


def host_buffer(numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """A zeroed flat host tensor, pinned when ``device`` is CUDA (pinned memory makes non-blocking copies real)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=device.type == "cuda")


def host_copy(flat: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """A host copy of a flat vector, reusing ``out`` when it fits; pinned when ``flat`` lives on CUDA."""
    flat = flat.detach()
    if out is None or out.shape != flat.shape or out.dtype != flat.dtype:
        out = host_buffer(flat.numel(), flat.device, flat.dtype).view(flat.shape)
    out.copy_(flat)
    return out


@torch.no_grad()
def read_into(tensors: Sequence[Tensor], out: Tensor, device: torch.device) -> Tensor:
    """Copy ``tensors`` (on ``device``) into the flat host buffer ``out``, in order, and wait for the copies."""
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].copy_(t.reshape(-1), non_blocking=True)
        offset += t.numel()
    sync_device(device)  # the host reads ``out`` next: the non-blocking copies must have landed
    return out


@torch.no_grad()
def write_from(tensors: Sequence[Tensor], flat: Tensor, device: torch.device) -> None:
    """Copy the flat host buffer ``flat`` into ``tensors`` (on ``device``), in order."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t), non_blocking=True)
        offset += t.numel()
    sync_device(device)  # ``flat`` may be overwritten by the next receive: finish reading it first


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_cpu(obj: Any) -> Any:
    """A nested structure with every tensor detached and moved to the CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def state_to_bytes(state: Mapping[str, Any]) -> Tensor:
    """A state dict (e.g. an optimizer's, on any device) serialized into a uint8 CPU tensor. The bytes are a
    snapshot: later in-place updates of the state's tensors do not reach them."""
    buffer = io.BytesIO()
    torch.save(to_cpu(dict(state)), buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def state_from_bytes(data: Tensor) -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`, with CPU tensors. Loaded with ``weights_only=True``, as Lightning loads
    checkpoint files: tensors, numbers, strings and containers (what torch's optimizers keep) only."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
