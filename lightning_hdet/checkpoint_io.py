"""Reading checkpoints with an error that says what is wrong with the file, not where the unpickler stopped;
state dicts as bytes, to send them between processes."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device


def read_checkpoint(load: Callable[[], dict[str, Any]], path: Any) -> dict[str, Any]:
    """Call ``load()`` (the strategy's own reader) and turn an unreadable file into a clear ``RuntimeError``.

    A missing file keeps Lightning's own error. A truncated or corrupted file (an interrupted write, a damaged
    disk) is reported with its path, so the user knows to resume from an earlier checkpoint.
    """
    try:
        checkpoint = load()
    except FileNotFoundError:
        raise
    except Exception as err:
        raise RuntimeError(
            f"Cannot read the checkpoint {str(path)!r}: the file is truncated or corrupted ({type(err).__name__}: "
            f"{err}). Resume from an earlier checkpoint (e.g. another file of the ModelCheckpoint directory)."
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise RuntimeError(
            f"The checkpoint {str(path)!r} is not a Lightning checkpoint: it has no `state_dict` (found {found})."
        )
    return checkpoint


def state_to_bytes(state: Mapping[str, Any]) -> torch.Tensor:
    """A state dict (e.g. an optimizer's, on any device) serialized into a uint8 CPU tensor. The bytes are a
    snapshot: later in-place updates of the state's tensors do not reach them."""
    buffer = io.BytesIO()
    torch.save(move_data_to_device(state, torch.device("cpu")), buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def state_from_bytes(data: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`, with CPU tensors. Loaded with ``weights_only=True``, as Lightning loads
    checkpoint files: tensors, numbers, strings and containers (what torch's optimizers keep) only."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
