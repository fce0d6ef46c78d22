"""Dynamic local steps (DyLU), pure bookkeeping: each worker's round length in proportion to its speed.

Worker ``w`` with smoothed speed ``v_w`` and exchange time ``e_w`` gets ``floor(v_w * (T - e_w))`` steps (at least
``min_local_steps``), ``T = min_u (H / v_u + e_u)`` the quickest worker's cycle at ``H`` steps, so all finish their
rounds together. Why the exchange time counts (the published rule equalizes compute only): a worker with slower
exchanges would push less often, its pushes staler, and the momentum keeps the model from settling (issue 42).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_hdet._checks import KnownArguments, check_int, check_number, require


def smoothed_speed(previous: float | None, measured: float, smoothing: float) -> float:
    """``smoothing * previous + (1 - smoothing) * measured``."""
    return measured if previous is None else smoothing * previous + (1.0 - smoothing) * measured


def dynamic_local_steps(speed: float | None, speeds: Mapping[int, float], local_steps: int, min_local_steps: int,
                        exchange: float = 0.0, exchanges: Mapping[int, float] | None = None) -> int:
    """``max(min, floor(speed * (T - exchange)))``, ``T`` the quickest cycle at ``H`` (``H`` if unknown)."""
    exchanges = exchanges or {}
    cycles = [local_steps / v + exchanges.get(u, 0.0) for u, v in speeds.items() if v > 0]
    if speed is None or speed <= 0 or not cycles:
        return local_steps
    return max(min_local_steps, min(local_steps, math.floor(speed * (min(cycles) - exchange) + 1e-9)))


class LocalStepsPolicy(KnownArguments):
    """Per-worker speeds and each next round's length (``dynamic=False``: always ``H``)."""

    def __init__(self, local_steps: int, min_local_steps: int = 1, dynamic: bool = True, smoothing: float = 0.5) -> None:
        check_int("local_steps", local_steps, minimum=1)
        check_int("min_local_steps", min_local_steps, minimum=1)
        if min_local_steps > local_steps:
            raise ValueError(f"`min_local_steps` ({min_local_steps}) must not exceed `local_steps` ({local_steps}).")
        check_number("speed_smoothing", smoothing, low=0, high=1, high_open=True)
        self.local_steps, self.min_local_steps = local_steps, min_local_steps
        self.dynamic, self.smoothing = dynamic, smoothing
        self.speeds: dict[int, float] = {}
        self.exchanges: dict[int, float] = {}

    def update(self, worker: int, steps: int, seconds: float, exchange_s: float = 0.0) -> None:
        """``worker`` ran ``steps`` in ``seconds`` of compute; its last exchange took ``exchange_s``."""
        if steps <= 0 or seconds <= 0:
            return
        self.speeds[worker] = smoothed_speed(self.speeds.get(worker), steps / seconds, self.smoothing)
        self.exchanges[worker] = smoothed_speed(self.exchanges.get(worker), max(exchange_s, 0.0), self.smoothing)

    def forget(self, worker: int) -> None:
        self.speeds.pop(worker, None)
        self.exchanges.pop(worker, None)

    def next_local_steps(self, worker: int) -> int:
        if not self.dynamic:
            return self.local_steps
        return dynamic_local_steps(self.speeds.get(worker), self.speeds, self.local_steps, self.min_local_steps,
                                   self.exchanges.get(worker, 0.0), self.exchanges)

    def state_dict(self) -> dict[str, Any]:
        return {"speeds": dict(self.speeds), "exchanges": dict(self.exchanges)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.speeds = {int(k): float(v) for k, v in state["speeds"].items()}
        # checkpoints before the exchange times were kept lack them: compute alone until the next rounds report
        self.exchanges = {int(k): float(v) for k, v in state.get("exchanges", {}).items()}


@dataclass(frozen=True)
class AdaptiveSteps(KnownArguments):
    """Async rounds adapted to each worker's speed (the default; an integer ``local_steps=H`` fixes every round at
    ``H``): dynamic local steps (DyLU), ``start`` steps for the fastest worker, fewer for slower ones.

    Args:
        start: ``H``, the fastest worker's round length.
        min: the shortest round.
        grace_period: pushes within this many seconds of a batch's first one are applied as one batch.
        smoothing: the previous value's weight in each worker's steps/s average, in [0, 1).
    """

    start: int = 50
    min: int = 1
    grace_period: float = 0.0
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        check_int("start", self.start, minimum=1, hint="The fastest worker's round length, H.")
        check_int("min", self.min, minimum=1)
        require("min", self.min, self.min <= self.start, f"at most start={self.start}")
        check_number("grace_period", self.grace_period, low=0, hint="It is in seconds; 0 applies each push alone.")
        check_number("smoothing", self.smoothing, low=0, high=1, high_open=True)

    def numbers(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
