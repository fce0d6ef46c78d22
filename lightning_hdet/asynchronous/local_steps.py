"""Dynamic local steps (DyLU): give each worker a round length proportional to its speed.

Worker ``w`` with smoothed speed ``v_w`` (inner steps per second) runs ``floor(v_w / max_u v_u * H)`` inner
steps in its next round, at least ``min_local_steps``, so that fast and slow workers finish their rounds at
about the same time. Pure bookkeeping: no Lightning, no process groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_hdet._checks import check_int, check_number


def smoothed_speed(previous: float | None, measured: float, smoothing: float) -> float:
    """Exponential moving average of steps/s: ``smoothing * previous + (1 - smoothing) * measured``."""
    if previous is None:
        return measured
    return smoothing * previous + (1.0 - smoothing) * measured


def dynamic_local_steps(speed: float | None, speeds: Mapping[int, float], local_steps: int, min_local_steps: int) -> int:
    """``max(min_local_steps, floor(speed / max(speeds) * local_steps))``; ``local_steps`` if speed is unknown."""
    fastest = max(speeds.values(), default=0.0)
    if speed is None or fastest <= 0:
        return local_steps
    return max(min_local_steps, math.floor(speed / fastest * local_steps + 1e-9))


class LocalStepsPolicy:
    """Per-worker speed bookkeeping and the next round's local step count.

    Args:
        local_steps: ``H``, the round length of the fastest worker.
        min_local_steps: lower bound for any worker's round.
        dynamic: when False every worker always runs ``H`` steps.
        smoothing: weight of the previous speed in the moving average, in [0, 1).
    """

    def __init__(self, local_steps: int, min_local_steps: int = 1, dynamic: bool = True, smoothing: float = 0.5) -> None:
        validate_local_steps(local_steps, min_local_steps, smoothing)
        self.local_steps = local_steps
        self.min_local_steps = min_local_steps
        self.dynamic = dynamic
        self.smoothing = smoothing
        self.speeds: dict[int, float] = {}

    def update(self, worker: int, steps: int, seconds: float) -> None:
        """Record that ``worker`` ran ``steps`` inner steps in ``seconds`` of compute."""
        if steps <= 0 or seconds <= 0:
            return
        self.speeds[worker] = smoothed_speed(self.speeds.get(worker), steps / seconds, self.smoothing)

    def next_local_steps(self, worker: int) -> int:
        """The number of inner steps ``worker`` should run in its next round."""
        if not self.dynamic:
            return self.local_steps
        return dynamic_local_steps(self.speeds.get(worker), self.speeds, self.local_steps, self.min_local_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"speeds": dict(self.speeds)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.speeds = {int(k): float(v) for k, v in state["speeds"].items()}


def validate_local_steps(local_steps: int, min_local_steps: int, smoothing: float = 0.5) -> None:
    """Raise a ValueError naming the argument when ``H``, its lower bound or the speed smoothing is invalid."""
    check_int("local_steps", local_steps, minimum=1)
    check_int("min_local_steps", min_local_steps, minimum=1)
    if min_local_steps > local_steps:
        raise ValueError(f"`min_local_steps` ({min_local_steps}) must not exceed `local_steps` ({local_steps}).")
    check_number("speed_smoothing", smoothing, low=0, high=1, high_open=True)
