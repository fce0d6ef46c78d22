"""Reading checkpoints with an error that says what is wrong with the file, not where the unpickler stopped."""

from __future__ import annotations

from typing import Any, Callable



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
