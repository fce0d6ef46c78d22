"""Words of the package's console lines that hdet/ and asynchronous/ share (pure; imports neither)."""

from __future__ import annotations


def counted(n: int, noun: str) -> str:
    """``"1 rank"``, ``"4 ranks"``: a count with its noun in the right number (regular plurals only)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
