"""Argument checks shared by the strategies and the callback."""

from __future__ import annotations

import math
from typing import Any


def is_finite_number(value: Any) -> bool:
    """An ``int`` or ``float`` (not a ``bool``) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
