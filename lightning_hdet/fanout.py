"""The published symmetric learning-rate fan-out (ALGORITHMS.md §1.1).

Member ``g`` of ``G`` gets ``rho_g = 1 + spread * (g - (G - 1) / 2) / max((G - 1) / 2, 0.5)``: the multipliers
average exactly 1 and lie in ``[1 - spread, 1 + spread]``. ``spread = 0`` gives plain data parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def fan_out(num_groups: int, spread: float) -> list[float]:
    """Return one learning-rate multiplier per group, symmetric around 1."""
    check_num_groups(num_groups)
    check_spread(spread)
    center = (num_groups - 1) / 2
    half_width = max(center, 0.5)
    return [1.0 + spread * (g - center) / half_width for g in range(num_groups)]


def check_num_groups(num_groups: int) -> None:
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"`num_groups` must be a positive integer (or None for one group per rank), got {num_groups!r}.")


def check_spread(spread: float) -> None:
    if not isinstance(spread, (int, float)) or isinstance(spread, bool) or not (0.0 <= spread < 1.0):
        raise ValueError(f"`spread` must be a number in [0, 1), got {spread!r}; 0 means plain DDP.")


def check_multipliers(multipliers: Sequence[float], name: str = "lr_multipliers") -> list[float]:
    """Validate a sequence of learning-rate multipliers: finite, positive numbers."""
    if isinstance(multipliers, (str, bytes)) or not isinstance(multipliers, Sequence) or len(multipliers) == 0:
        raise ValueError(f"`{name}` must be a non-empty sequence of positive finite numbers, got {multipliers!r}.")
    values = []
    for m in multipliers:
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"`{name}` must contain positive finite numbers only, got {list(multipliers)!r}.")
        values.append(float(m))
    return values
