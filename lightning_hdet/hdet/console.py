"""How HDET's console lines spell floats: rounded (pure; counts with their noun: :mod:`lightning_hdet._text`)."""

from __future__ import annotations

from collections.abc import Iterable

DIGITS = 4  # significant digits of a float in a console line: enough to compare groups, short enough to read


def rounded(value: float) -> str:
    """A float with :data:`DIGITS` significant digits (``nan`` and ``inf`` spelled as Python does)."""
    return f"{value:.{DIGITS}g}"


def rounded_list(values: Iterable[float]) -> str:
    """``[0.4123, 1.5, nan]``: a list of floats, each :func:`rounded`."""
    return "[" + ", ".join(rounded(float(v)) for v in values) + "]"
