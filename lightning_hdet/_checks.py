"""The one way this package checks arguments.

Every check raises ``ValueError("`name` must be <allowed>, got <value>.")`` (plus a hint on what to do), so an
error always names the argument, the value and what is allowed. Checks run in constructors, before any process
or process group exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional


def require(name: str, value: Any, ok: bool, allowed: str, hint: str = "") -> None:
    """Raise the package's standard ``ValueError`` unless ``ok``."""
    if not ok:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}." + (f" {hint}" if hint else ""))


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """An ``int`` or ``float`` (not a ``bool``) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_int(name: str, value: Any, minimum: int = 0, optional: bool = False, hint: str = "") -> None:
    """An integer ``>= minimum`` (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    require(name, value, is_int(value) and value >= minimum, allowed + (" or None" if optional else ""), hint)


def check_number(
    name: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    hint: str = "",
) -> None:
    """A finite number in the interval given by ``low``/``high`` (open ends when ``*_open``)."""
    if optional and value is None:
        return
    ok = is_finite_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    require(name, value, ok, _interval(low, high, low_open, high_open) + (" or None" if optional else ""), hint)


def check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "") -> None:
    """One of ``choices``."""
    require(name, value, value in tuple(choices), f"one of {tuple(choices)}", hint)


def check_bool(name: str, value: Any) -> None:
    require(name, value, isinstance(value, bool), "True or False")


def check_positive_list(name: str, values: Any) -> list[float]:
    """A non-empty sequence of positive finite numbers, returned as floats."""
    ok = isinstance(values, Sequence) and not isinstance(values, (str, bytes)) and len(values) > 0
    ok = ok and all(is_finite_number(v) and v > 0 for v in values)
    require(name, values, ok, "a non-empty sequence of positive finite numbers")
    return [float(v) for v in values]


def _interval(low: Optional[float], high: Optional[float], low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return "a finite number"
    if high is None:
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_positive(name: str, value: Any) -> None:
    """A positive finite number."""
    require(name, value, is_finite_number(value) and value > 0, "a positive finite number")


def check_integer(name: str, value: Any) -> None:
    """Any integer (not a ``bool``), e.g. a seed."""
    require(name, value, is_int(value), "an integer")
