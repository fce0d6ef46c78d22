"""Blend rules: what the groups' parameters are merged toward (pure: no Lightning, no process groups).

The merge target is ``sum_g c_g * theta_g`` with coefficients ``c`` summing to 1 over the healthy groups; each
group then moves ``theta_g <- (1 - s_g) * theta_g + s_g * target``. A rescued (diverged) group always takes the
target fully (``s_g = 1``). The strategy does this with one all-reduce of the model's size.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_hdet._checks import check_choice

BLENDS = ("mean", "weighted", "best")


def blend_coefficients(blend: str, weights: Sequence[float], winner: int, healthy: Sequence[bool]) -> list[float]:
    """Coefficients of each group in the merge target.

    ``mean``: the published converge, equal weights over healthy groups; ``weighted``: the vote weights
    (renormalised over healthy groups); ``best``: the winner's parameters (population-based training's exploit).
    """
    check_choice("blend", blend, BLENDS)
    n = len(healthy)
    idx = [g for g, ok in enumerate(healthy) if ok]
    if not idx:
        raise ValueError("blend_coefficients needs at least one healthy group.")
    if blend == "mean":
        return [1.0 / len(idx) if ok else 0.0 for ok in healthy]
    if blend == "weighted":
        total = sum(weights[g] for g in idx)
        if total <= 0:
            return blend_coefficients("mean", weights, winner, healthy)
        return [weights[g] / total if healthy[g] else 0.0 for g in range(n)]
    if winner < 0 or not healthy[winner]:  # "best"
        raise ValueError(f"`best` blend needs a healthy winner, got winner={winner}.")
    return [1.0 if g == winner else 0.0 for g in range(n)]


def blend_strengths(strength: float, rescued: Sequence[bool]) -> list[float]:
    """Per-group strength: ``strength`` for healthy groups, 1 for rescued ones (they take the target fully)."""
    return [1.0 if bad else strength for bad in rescued]
