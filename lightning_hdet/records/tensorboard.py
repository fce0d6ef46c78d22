"""A TensorBoard run's scalars read back (``TensorBoardLogger``, Lightning's default logger), offline and pure.

Event files are TFRecord files: each record is ``uint64 length, uint32 crc, Event proto, uint32 crc``. The
``Event`` message is parsed with the proto classes of ``tensorboard`` or, where only the lighter ``tensorboardX``
is installed (what ``TensorBoardLogger`` then writes with), of ``tensorboardX``; nothing else of either is used.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

EVENTS_GLOB = "events.out.tfevents.*"
_HEADER = 12  # uint64 length + uint32 masked crc of the length
_FOOTER = 4  # uint32 masked crc of the data


def find_event_files(path: Path) -> list[Path]:
    """The event files of one run: ``path`` itself, those in it, or those below it (all in one folder)."""
    if path.is_file():
        return [path] if path.name.startswith("events.out.tfevents.") else []
    found = sorted(path.glob(EVENTS_GLOB)) or sorted(path.glob(f"**/{EVENTS_GLOB}"))
    folders = sorted({str(f.parent) for f in found})
    if len(folders) > 1:
        raise ValueError(f"run={str(path)!r} holds TensorBoard event files of several runs ({folders}); pass one of them")
    return found


def _event_class() -> Any:
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        try:
            from tensorboardX.proto.event_pb2 import Event
        except ImportError as err:
            raise ImportError(
                "Reading a TensorBoard run needs the `tensorboard` or `tensorboardX` package (what "
                "TensorBoardLogger writes with): pip install tensorboardX"
            ) from err
    return Event


def read_scalars(files: list[Path]) -> list[tuple[int, str, float]]:
    """``(step, tag, value)`` of every scalar in ``files``, in file order (a truncated last record is skipped)."""
    event_class = _event_class()
    scalars = []
    for path in files:
        data = path.read_bytes()
        offset = 0
        while offset + _HEADER <= len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            end = offset + _HEADER + length
            if end + _FOOTER > len(data):
                break  # still being written
            event = event_class.FromString(data[offset + _HEADER : end])
            for value in event.summary.value:
                number = _scalar(value)
                if number is not None:
                    scalars.append((int(event.step), value.tag, number))
            offset = end + _FOOTER
    return scalars


def _scalar(value: Any) -> float | None:
    """A summary value's number: ``simple_value`` (``add_scalar``) or a one-element float tensor (new style)."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and len(value.tensor.float_val) == 1:
        return float(value.tensor.float_val[0])
    return None
