"""Hyperparameters the groups explore besides the learning rate (pure: torch only, no Lightning, no process groups).

``HDETStrategy(explore={"weight_decay": 10.0})`` gives every group its own multiplier on each named param-group
hyperparameter, as it has one on the LR: a table per hyperparameter, one row per group and one column per optimizer
param group, applied around every optimizer step (the optimizer, its state and the schedulers never see it), moved
by the same votes as the LR (each hyperparameter a separate ballot of the same losses), logged, checkpointed and
replayed like the LR.

What a multiplier multiplies (:data:`ONE_MINUS`): most keys (``weight_decay``, ``eps``, ...) directly; a momentum
coefficient ``beta`` (``momentum``, ``beta1`` and ``beta2`` of Adam's ``betas``) through ``1 - beta``, its horizon
(a multiplier 2 halves the averaging window), since ``beta x 1.2`` leaves ``[0, 1)`` for ``beta > 0.83``.

The initial grid of a hyperparameter with span ``s`` is the LR's (:func:`~lightning_hdet.hdet.rules.defaults.span_grid`:
geometric within ``s ** -0.5 .. s ** 0.5``, one value exactly 1). The group at the LR's 1 (``user_group``) keeps 1 for
every hyperparameter, so the user's own configuration always trains; the ``k``-th hyperparameter after the LR rotates
the other values over the other groups by ``k``, so no two hyperparameters rise together over them (with four groups
and two hyperparameters: grid indices ``2, 1, 3, 0`` against the LR's ``0, 1, 2, 3``). A list gives each group its
multiplier itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import did_you_mean, is_finite_number, require
from lightning_hdet.hdet.multipliers import MultiplierTable, centred_grid
from lightning_hdet.hdet.rules.defaults import span_grid, user_group
from lightning_hdet.hdet.rules.votes import Ballot

#: Names whose multiplier acts on ``1 - value`` (a momentum coefficient), and where the value lives.
ONE_MINUS = {"momentum": ("momentum", None), "beta1": ("betas", 0), "beta2": ("betas", 1)}
#: Vote-rule state is kept per ballot key: the LR's param group ``p`` votes under ``p``, the ``k``-th explored
#: hyperparameter's under ``(k + 1) * KEY_STRIDE + p``.
KEY_STRIDE = 1_000_000

Span = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Explored:
    """What one vote sees of the explored hyperparameters (a snapshot, identical on every rank).

    ``tables``: every name's multipliers, ``(num_groups, num_param_groups)`` float64; ``bases``: what the optimizer
    says per flattened param group, in the multiplied quantity (``1 - beta`` for :data:`ONE_MINUS`); ``lr``: whether
    the votes move the LR (``explore={"lr": 1.0}``: every group keeps the optimizer's LR; the safety net still cuts a
    diverged group's)."""

    tables: dict[str, Tensor] = field(default_factory=dict)
    bases: dict[str, list[float]] = field(default_factory=dict)
    lr: bool = True


# ------------------------------------------------------------------ the argument
def check_explore(explore: Optional[Mapping[str, Span]], num_groups: Optional[int], lr_given: bool) -> dict[str, Span]:
    """Validate ``HDETStrategy(explore=...)`` before any process exists; the names and spans (or lists), in order."""
    if explore is None:
        return {}
    require("explore", explore, isinstance(explore, Mapping) and len(explore) > 0,
            "None or a non-empty dict of param-group hyperparameter names to spans, e.g. {'weight_decay': 10.0}")
    require("num_groups", num_groups, num_groups != 1, f"None or at least 2 with explore={dict(explore)!r}",
            "One group explores nothing: every group trains at the optimizer's values.")
    spec: dict[str, Span] = {}
    for name, span in explore.items():
        require("explore", name, isinstance(name, str) and name not in ("betas", "params"),
                "a dict keyed by param-group hyperparameter names (e.g. 'weight_decay', 'momentum', 'beta1', 'beta2')",
                "Adam's `betas` is explored one coefficient at a time: 'beta1', 'beta2'.")
        key = f"explore[{name!r}]"
        if name == "lr":
            require("lr_multipliers", "given", not lr_given, f"None with {key}",
                    "explore['lr'] is the LR's span (1.0: the LR is not explored); give one or the other.")
        if isinstance(span, Sequence) and not isinstance(span, (str, bytes)):
            ok = len(span) > 0 and all(is_finite_number(v) and v > 0 for v in span)
            require(key, span, ok and (num_groups is None or len(span) == num_groups),
                    "a span (a number > 1) or one positive multiplier per group")
            spec[name] = [float(v) for v in span]
        else:
            low = 1.0 if name == "lr" else 1.0 + 1e-12
            require(key, span, is_finite_number(span) and span >= low,
                    "a span: the ratio of the largest to the smallest multiplier, a finite number "
                    + (">= 1 (1.0: the LR is not explored)" if name == "lr" else "> 1"),
                    "" if name == "lr" else "A span of 1 explores nothing: leave the name out.")
            spec[name] = float(span)
    return spec


def initial_multipliers(span: Span, num_groups: int, position: int) -> list[float]:
    """The ``position``-th explored hyperparameter's multipliers when training starts (see the module docstring)."""
    if not isinstance(span, float):
        require("explore", list(span), len(span) == num_groups, f"one multiplier per group ({num_groups})")
        return list(span)
    grid = span_grid(num_groups, span)
    others = [g for g in range(num_groups) if g != user_group(num_groups)]  # the user's group keeps 1
    out = list(grid)
    for i, g in enumerate(others):
        out[g] = grid[others[(i + position) % len(others)]]
    return out


# ------------------------------------------------------------------ the optimizer's values
def read(group: Mapping[str, Any], name: str) -> Any:
    """The value ``name`` has in one param group (``None``: it has none)."""
    key, index = ONE_MINUS.get(name, (name, None))
    value = group.get(key)
    if index is not None:
        return value[index] if isinstance(value, (tuple, list)) and len(value) > index else None
    return value


def base(group: Mapping[str, Any], name: str) -> float:
    """The quantity a multiplier multiplies: the value, or ``1 - value`` for :data:`ONE_MINUS`."""
    value = float(read(group, name))
    return 1.0 - value if name in ONE_MINUS else value


def applied(name: str, value: float, multiplier: float) -> float:
    """The value a group trains with: ``value * m``, or ``1 - (1 - value) * m`` (at least 0) for a momentum."""
    if name in ONE_MINUS:
        return max(1.0 - (1.0 - value) * multiplier, 0.0)
    return value * multiplier


def check_optimizers(optimizers: Sequence[Optimizer], names: Sequence[str]) -> None:
    """Every param group holds every explored name as a number a multiplier changes (raised when ``fit`` starts)."""
    for i, opt in enumerate(optimizers):
        for j, pg in enumerate(opt.param_groups):
            have = sorted(k for k, v in pg.items() if is_finite_number(v) and k != "lr")
            have += [n for n in ("beta1", "beta2") if is_finite_number(read(pg, n))]
            for name in names:
                if name == "lr":
                    continue
                value = read(pg, name)
                where = f"HDETStrategy(explore={{{name!r}: ...}}): optimizer {i} ({type(opt).__name__}) param group {j}"
                if not is_finite_number(value):
                    raise ValueError(f"{where} has {name}={value!r}; allowed names: the numeric hyperparameters its "
                                     f"param groups hold, {have}. {did_you_mean(name, have, repr)}".rstrip())
                momentum = name in ONE_MINUS
                if value == 0 or (momentum and not 0 < value < 1):
                    allowed = "in (0, 1)" if momentum else "non-zero"
                    raise ValueError(f"{where} has {name}={value!r}, which a multiplier cannot explore (allowed: "
                                     f"{allowed}); set the optimizer's {name} to the value to search around.")


def bases(optimizers: Sequence[Optimizer], names: Sequence[str]) -> dict[str, list[float]]:
    """What the optimizers say for every explored name, per flattened param group (the multiplied quantity)."""
    return {n: [base(pg, n) for opt in optimizers for pg in opt.param_groups] for n in names}


@contextmanager
def scaled(optimizer: Optimizer, rows: Mapping[str, Sequence[float]]) -> Iterator[None]:
    """Give each param group its multiplied values of every name in ``rows`` for one step, then the optimizer's own
    back (as :func:`~lightning_hdet.hdet.multipliers.scaled_lr` does for the LR)."""
    saved = [{ONE_MINUS.get(n, (n, None))[0]: pg[ONE_MINUS.get(n, (n, None))[0]] for n in rows}
             for pg in optimizer.param_groups]
    try:
        for name, row in rows.items():
            key, index = ONE_MINUS.get(name, (name, None))
            for pg, m in zip(optimizer.param_groups, row):
                value = applied(name, float(read(pg, name)), float(m))
                if index is None:
                    pg[key] = value
                else:
                    pg[key] = tuple(value if i == index else b for i, b in enumerate(pg[key]))
        yield
    finally:
        for pg, values in zip(optimizer.param_groups, saved):
            pg.update(values)


# ------------------------------------------------------------------ the strategy's tables
class ExploredTables:
    """The strategy's multiplier tables of the explored hyperparameters (the one owner; see the module)."""

    def __init__(self, spec: Mapping[str, Span], num_groups: int) -> None:
        self.lr = not (spec.get("lr") == 1.0)
        names = [n for n in spec if n != "lr"]
        self._tables = {n: MultiplierTable(initial_multipliers(spec[n], num_groups, k + 1))
                        for k, n in enumerate(names)}

    @property
    def names(self) -> list[str]:
        return list(self._tables)

    def get(self, num_param_groups: int) -> dict[str, Tensor]:
        return {n: t.get(num_param_groups) for n, t in self._tables.items()}

    def set(self, tables: Mapping[str, Any], num_groups: int, num_param_groups: int) -> None:
        """Replace the tables (the one writer): the names must be the explored ones."""
        require("explored", sorted(tables), sorted(tables) == sorted(self._tables),
                f"tables for the explored names {sorted(self._tables)}",
                "A checkpoint of a run that explored other hyperparameters resumes with the same `explore`.")
        for name, table in tables.items():
            self._tables[name].set(table, num_groups, num_param_groups)

    def rows(self, group: int, num_param_groups: int, offset: int, width: int) -> dict[str, list[float]]:
        """Group ``group``'s multipliers of one optimizer's param groups (cached floats: the per-step path)."""
        return {n: t.row(group, num_param_groups)[offset : offset + width] for n, t in self._tables.items()}


# ------------------------------------------------------------------ the votes (called by the controller)
def vote_explored(rule: Any, generator: torch.Generator, explored: Explored, losses: Sequence[float],
                  healthy: Sequence[bool], move: bool) -> dict[str, Tensor]:
    """Every explored table after one vote: each (name, param group) column is a ballot of the same ``losses``, with
    its own key (the rule keeps state per key) and the column's multipliers and base value."""
    out: dict[str, Tensor] = {}
    for k, (name, table) in enumerate(explored.tables.items()):
        table = table.clone()
        for p, value in enumerate(explored.bases.get(name, [])[: table.shape[1]]):
            column = Ballot((k + 1) * KEY_STRIDE + p, losses, table[:, p].tolist(), healthy, value, move)
            table[:, p] = torch.tensor(rule.explore(column, generator).multipliers, dtype=torch.float64)
        out[name] = table
    return out


def refined(tables: Mapping[str, Tensor], winner: int, ratio: float) -> dict[str, Tensor]:
    """At the end of a search: each table a grid of ratio ``ratio`` around the winner's row, in the initial order."""
    out = {}
    for k, (name, table) in enumerate(tables.items()):
        num_groups = table.shape[0]
        grid = centred_grid(table[winner].tolist(), num_groups, ratio)
        out[name] = grid[[(g + k + 1) % num_groups for g in range(num_groups)]]
    return out


def metrics(values_: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """What the loggers get: ``hdet/group{g}/{name}``, every group's real value (as ``hdet/group{g}/lr``)."""
    return {f"hdet/group{g}/{name}": float(v) for name, row in values_.items() for g, v in enumerate(row)}


def values(tables: Mapping[str, Tensor], explored: Explored) -> dict[str, list[float]]:
    """Every group's real value of each name in its first param group (for the logs and the vote history)."""
    out = {}
    for name, table in tables.items():
        quantity = explored.bases[name][0] if explored.bases.get(name) else math.nan
        value = 1.0 - quantity if name in ONE_MINUS else quantity
        out[name] = [applied(name, value, m) for m in table[:, 0].tolist()]
    return out
