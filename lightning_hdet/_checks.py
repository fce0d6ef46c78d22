"""The one way this package checks arguments.

Every check raises ``ValueError("`name` must be <allowed>, got <value>.")`` (plus a hint on what to do), so an
error always names the argument, the value and what is allowed. Checks run in constructors, before any process
or process group exists. A keyword argument no constructor knows raises :class:`ArgumentNameError`, naming the
closest valid name (:func:`check_names`; :class:`KnownArguments` for constructors without ``**kwargs``); a string
outside a fixed set of choices is answered with the closest choice (:func:`check_choice`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Mapping, Sequence
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


def check_choice(name: str, value: Any, choices: Sequence[Any], hint: str = "", other: str = "") -> None:
    """One of ``choices`` (or, with ``other``, what it describes, e.g. "a Vote object", which the caller accepted
    before calling); a misspelled string is answered with the closest choice."""
    choices = tuple(choices)
    if any(_is_choice(value, choice) for choice in choices):
        return
    allowed = repr(choices[0]) if len(choices) == 1 else f"one of {choices}"
    require(name, value, False, allowed + (f" or {other}" if other else ""),
            " ".join(part for part in (did_you_mean(value, choices, repr), hint) if part))


def _is_choice(value: Any, choice: Any) -> bool:
    """``value == choice``, and a number of the choice's own type: ``True`` is not the choice ``1`` (``bool`` is an
    ``int``), nor ``2.0`` the choice ``2``."""
    if isinstance(choice, (int, float)):
        return type(value) is type(choice) and value == choice
    return bool(value == choice)


def did_you_mean(given: Any, valid: Sequence[Any], show: Any = "`{}`".format) -> str:
    """"Did you mean <the valid string closest to ``given``>?", or "" when ``given`` is not a string or none is
    close."""
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, [v for v in valid if isinstance(v, str)], n=1)
    return f"Did you mean {show(close[0])}?" if close else ""


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


class ArgumentNameError(TypeError, ValueError):
    """A keyword argument the constructor does not know: a ``TypeError`` as Python's own, and a ``ValueError`` as
    every other check of this package (so either ``except`` catches it)."""


def check_names(owner: str, given: Mapping[str, Any], own: Sequence[str],
                passed_on: Optional[Mapping[str, Sequence[str]]] = None, hint: str = "") -> None:
    """Refuse a keyword of ``given`` that is neither one of ``owner``'s ``own`` arguments nor one of ``passed_on``'s
    (where the rest go, e.g. ``{"DistributedDataParallel": (...)}``: only names that are really used there), naming
    the closest valid name and ``owner``'s own arguments."""
    passed_on = passed_on or {}
    valid = [*own, *(name for names in passed_on.values() for name in names)]
    for name, value in given.items():
        if name in valid:
            continue
        guess = did_you_mean(name, valid)
        guess = f" {guess}" if guess else ""
        rest = "".join(f"; {where}'s: {', '.join(names)}" for where, names in passed_on.items())
        raise ArgumentNameError(f"{owner} got an unsupported argument `{name}`={value!r}.{guess} Its own arguments:"
                                f" {', '.join(own)}{rest}." + (f" {hint}" if hint else ""))


@functools.lru_cache(maxsize=None)
def own_arguments(cls: type) -> tuple[str, ...]:
    """The keyword arguments ``cls``'s ``__init__`` names (not ``self``, ``*args`` or ``**kwargs``)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return tuple(p.name for p in parameters
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


@functools.lru_cache(maxsize=None)
def _takes_any_keyword(cls: type) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values())


class KnownArguments:
    """Base of a public class whose ``__init__`` takes no ``**kwargs`` (also a dataclass's generated one): a keyword
    it does not know is refused by :func:`check_names`, with the closest name, instead of Python's bare
    ``TypeError``. (A subclass whose ``__init__`` takes ``**kwargs``, e.g. a user's own rule, checks its own.)"""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not _takes_any_keyword(cls):
            check_names(cls.__name__, kwargs, own_arguments(cls))
        return super().__new__(cls)
