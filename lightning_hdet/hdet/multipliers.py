"""The learning-rate multiplier table: one row per HDET group, one column per optimizer param group (pure)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer


class MultiplierTable:
    """Owns every group's multipliers, float64 on the host; the strategy applies its own row around each step.

    Param groups added during training (e.g. by fine-tuning callbacks) start with their group's first multiplier.
    """

    def __init__(self, initial: Sequence[float]) -> None:
        self._table = torch.tensor(list(initial), dtype=torch.float64)[:, None]
        self._rows: dict[int, list[float]] = {}  # plain floats per group, for the per-step path

    def get(self, num_param_groups: int) -> Tensor:
        """A copy of the table, widened to ``num_param_groups`` columns."""
        self._widen(num_param_groups)
        return self._table.clone()

    def row(self, group: int, num_param_groups: int) -> list[float]:
        """Group ``group``'s multipliers as floats, cached until the table changes: every optimizer step reads
        them, so this path allocates nothing."""
        if self._table.shape[1] < num_param_groups:
            self._widen(num_param_groups)
        if group not in self._rows:
            self._rows[group] = self._table[group].tolist()
        return self._rows[group]

    def _widen(self, num_param_groups: int) -> None:
        missing = num_param_groups - self._table.shape[1]
        if missing > 0:
            self._table = torch.cat([self._table, self._table[:, :1].expand(-1, missing)], dim=1)
            self._rows.clear()

    def set(self, multipliers: Any, num_groups: int, num_param_groups: int) -> None:
        """Replace the table: ``G`` values (all param groups alike) or a ``G x P`` table; positive and finite."""
        table = torch.as_tensor(multipliers, dtype=torch.float64).clone()
        if table.dim() == 1:
            table = table[:, None].expand(-1, max(num_param_groups, 1)).clone()
        if table.dim() != 2 or table.shape[0] != num_groups:
            raise ValueError(f"`multipliers` must have one row per group ({num_groups}), got shape {tuple(table.shape)}.")
        if not bool(torch.isfinite(table).all()) or bool((table <= 0).any()):
            raise ValueError(f"`multipliers` must be positive and finite, got {table.tolist()}.")
        self._table = table
        self._rows.clear()


def centred_grid(row: Sequence[float], num_groups: int, ratio: float) -> Tensor:
    """A ``num_groups x len(row)`` table: group ``g`` gets ``row * ratio ** (g - (num_groups - 1) / 2)``, a geometric
    grid with ``ratio`` between neighbouring groups whose geometric mean is ``row`` (where a search ended)."""
    powers = torch.arange(num_groups, dtype=torch.float64) - (num_groups - 1) / 2
    return torch.tensor(list(row), dtype=torch.float64)[None, :] * (float(ratio) ** powers)[:, None]


def param_group_offset(optimizers: Sequence[Optimizer], optimizer: Optimizer) -> int:
    """Index of ``optimizer``'s first param group in the flattened list over all ``optimizers``."""
    offset = 0
    for opt in optimizers:
        if opt is optimizer:
            return offset
        offset += len(opt.param_groups)
    raise ValueError("The optimizer is not one of the strategy's optimizers.")


def schedule_lrs(optimizers: Sequence[Optimizer]) -> Tensor:
    """The learning rate the optimizers and schedulers say, per flattened param group (float64)."""
    return torch.tensor([float(pg["lr"]) for opt in optimizers for pg in opt.param_groups], dtype=torch.float64)


@contextmanager
def scaled_lr(optimizer: Optimizer, multipliers: Sequence[float]) -> Iterator[None]:
    """Multiply each param group's ``lr`` by its multiplier for the duration of one step, then restore it, so the
    optimizer's state and the schedulers never see (or compound) the multiplier."""
    saved = [pg["lr"] for pg in optimizer.param_groups]
    try:
        for pg, m in zip(optimizer.param_groups, multipliers):
            pg["lr"] = pg["lr"] * float(m)
        yield
    finally:
        for pg, lr in zip(optimizer.param_groups, saved):
            pg["lr"] = lr


def check_numeric_lrs(optimizers: Sequence[Optimizer]) -> None:
    """HDET scales each param group's ``lr``: every one must be a finite number (raised when ``fit`` starts)."""
    for i, opt in enumerate(optimizers):
        for j, pg in enumerate(opt.param_groups):
            lr = pg.get("lr")
            if isinstance(lr, Tensor):
                lr = float(lr)
            if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr):
                raise ValueError(
                    f"HDETStrategy scales each param group's `lr`, but optimizer {i} ({type(opt).__name__}) "
                    f"param group {j} has lr={pg.get('lr')!r}; use an optimizer with a numeric learning rate."
                )
