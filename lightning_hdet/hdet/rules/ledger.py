"""The vote ledger: what every vote decided, row by row, and the counters over them (pure: no Lightning).

:class:`VoteLedger` is the controller's record of its votes: one ``history`` row per group per vote (with the LR
the group trained at, ``trained_lr``, as well as the one the vote set), the rescue and vote counts, and the last
winner. It checkpoints its part of the controller's ``state_dict`` under the same keys as before it was split out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

from lightning_hdet.hdet.hyperparams import values

if TYPE_CHECKING:  # (the controller imports this module)
    from lightning_hdet.hdet.rules.controller import Decision, Interval


class VoteLedger:
    """Every vote's rows (``history``) and the counters ``rescues``, ``num_votes`` and ``last_winner``."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        # Every group's real LR (first param group) when training started: the first vote's `trained_lr`. Set by the
        # callback (or Fabric loop) at the start of fit; later votes take the `lr` the vote before set.
        self.initial_lrs: list[float] = []
        self.rescues = 0
        self.num_votes = 0
        self.last_winner = -1

    def record(self, decision: Decision, interval: Interval, edge: int, clear: Optional[bool]) -> None:
        """Count the vote and append one row per group."""
        self.rescues += sum(decision.rescued)
        # A roll-back counts as a vote even at the final merge (it moved the learning rates).
        self.num_votes += 0 if interval.final and not decision.roll_back else 1
        self.last_winner = decision.winner
        # `lr` (and `explored`) is what the vote set, from this vote on; the loss was reached from the values the
        # interval started at: `trained_lr` (and `trained_explored`).
        lrs = decision.lrs
        trained, was = _started_at(self.history, self.initial_lrs, interval, bool(decision.values))
        for g in range(len(decision.losses)):
            self.history.append(
                {"step": decision.step, "group": g, "lr": lrs[g], "loss": decision.losses[g],
                 "weight": decision.weights[g], "winner": decision.winner, "rescued": bool(decision.rescued[g]),
                 "reason": decision.reasons[g] if decision.reasons else "", "edge": edge,
                 "clear": "" if clear is None else int(clear), "trained_lr": trained[g],
                 **({"explored": {n: v[g] for n, v in decision.values.items()},
                     "trained_explored": {n: v[g] for n, v in was.items()}} if decision.values else {})}
            )

    def state_dict(self) -> dict[str, Any]:
        """Its part of the controller's checkpoint (``initial_lrs`` left out while empty, as before it existed)."""
        return {
            "history": list(self.history),
            "rescues": self.rescues,
            "num_votes": self.num_votes,
            "last_winner": self.last_winner,
            **({"initial_lrs": list(self.initial_lrs)} if self.initial_lrs else {}),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from the controller's checkpoint (older ones: rows without ``trained_lr``, no ``initial_lrs``)."""
        self.history = _with_trained_lr(state_dict["history"])
        self.initial_lrs = list(state_dict.get("initial_lrs", []))
        self.rescues = state_dict["rescues"]
        self.num_votes = state_dict["num_votes"]
        self.last_winner = state_dict["last_winner"]


def _started_at(history: Sequence[dict[str, Any]], initial_lrs: Sequence[float], interval: Interval,
                explored: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Every group's LR (and explored values) at the interval's first step: what the last vote set, or at the
    first vote the initial LRs (NaN where unknown) and the explored values the interval's tables give."""
    num_groups = len(interval.losses)
    last = history[-num_groups:]
    if history and [row["group"] for row in last] == list(range(num_groups)):
        was = {n: [row["explored"][n] for row in last] for n in last[0].get("explored", {})} if explored else {}
        return [row["lr"] for row in last], was
    now = values(interval.explored.tables, interval.explored) if explored else {}
    known = len(initial_lrs) == num_groups
    return (list(initial_lrs) if known else [math.nan] * num_groups), now


def _with_trained_lr(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, each with ``trained_lr``: a row from before it existed gets the ``lr`` its group's row of the vote
    before holds (NaN at the first vote: the initial LRs were not kept)."""
    rows: list[dict[str, Any]] = []
    set_by: dict[int, float] = {}  # every group's `lr` of the last vote read
    for row in history:
        rows.append(row if "trained_lr" in row else {**row, "trained_lr": set_by.get(row["group"], math.nan)})
        set_by[row["group"]] = row["lr"]
    return rows
