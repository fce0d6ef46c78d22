"""The vote's random generator, built on first use, that crosses a spawn (pure: no Lightning)."""

from __future__ import annotations

from typing import Any, Optional

import torch


class LazyGenerator:
    """A ``torch.Generator`` seeded on first use, pickled as the bytes of its state."""

    def __init__(self) -> None:
        self._generator: Optional[torch.Generator] = None

    def get(self, seed: int) -> torch.Generator:
        """The generator; seeded with ``seed`` if this is its first use (later calls ignore ``seed``)."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(seed)
        return self._generator

    def __getstate__(self) -> dict[str, Any]:
        # A torch.Generator cannot cross torch.multiprocessing's spawn under the default sharing strategy (PyTorch
        # #146828: "unable to resize file"), and the spawn launcher pickles every callback: send its state as bytes.
        generator = self._generator
        return {"state": None if generator is None else bytes(generator.get_state().numpy().tobytes())}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._generator = None
        if state["state"] is not None:
            self._generator = torch.Generator()
            self._generator.set_state(torch.frombuffer(bytearray(state["state"]), dtype=torch.uint8))
