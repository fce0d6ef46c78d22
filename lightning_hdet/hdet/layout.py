"""Which ranks form which HDET group, and the groups' initial learning-rate multipliers (pure: no process groups).

Groups are contiguous blocks of equal size. Ranks are numbered node by node, so a group stays inside one node
whenever the group size divides the number of processes per node, keeping its gradient traffic local.

The published symmetric fan-out (ALGORITHMS.md §1.1): member ``g`` of ``G`` gets
``rho_g = 1 + spread * (g - (G - 1) / 2) / max((G - 1) / 2, 0.5)``; the multipliers average exactly 1 and lie
in ``[1 - spread, 1 + spread]``. ``spread = 0`` gives plain data parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hdet._checks import check_number, check_positive_list, is_int, require
from lightning_hdet.hdet.rules.defaults import default_num_groups, incumbent_grid, span_grid


def fan_out(num_groups: int, spread: float) -> list[float]:
    """Return one learning-rate multiplier per group, symmetric around 1."""
    check_num_groups(num_groups)
    check_spread(spread)
    center = (num_groups - 1) / 2
    half_width = max(center, 0.5)
    return [1.0 + spread * (g - center) / half_width for g in range(num_groups)]


def initial_multipliers(num_groups: int, requested: Optional[Sequence[float]], spread: Optional[float],
                        lr_span: Optional[float], clusters: bool, preset_span: Optional[float]) -> list[float]:
    """The groups' starting multipliers: the ``requested`` ones; else ``explore={"lr": lr_span}``'s geometric grid;
    else the published ``spread``'s fan-out; else the preset's geometric grid (``clusters``: with the user's LR on
    the middle groups)."""
    if requested is not None:
        return list(requested)
    if lr_span is not None:
        return span_grid(num_groups, lr_span)
    if spread is not None:
        return fan_out(num_groups, spread)
    assert preset_span is not None
    return (incumbent_grid if clusters else span_grid)(num_groups, preset_span)


def check_num_groups(num_groups: int) -> None:
    require("num_groups", num_groups, is_int(num_groups) and num_groups >= 1,
            "a positive integer (or None: chosen from the world size, see defaults.default_num_groups)")


def check_spread(spread: float) -> None:
    check_number("spread", spread, 0.0, 1.0, high_open=True, hint="0 means plain DDP.")


def check_multipliers(multipliers: Sequence[float], name: str = "lr_multipliers") -> list[float]:
    """Validate a sequence of learning-rate multipliers: finite, positive numbers."""
    return check_positive_list(name, multipliers)


@dataclass(frozen=True)
class GroupLayout:
    """The split of ``world_size`` ranks into ``num_groups`` contiguous groups of equal size."""

    world_size: int
    num_groups: int

    def __post_init__(self) -> None:
        check_num_groups(self.num_groups)
        allowed = ", ".join(map(str, divisors(self.world_size)))
        if self.num_groups > self.world_size:
            raise ValueError(
                f"`num_groups={self.num_groups}` is larger than the number of ranks ({self.world_size}); "
                f"allowed: a divisor of {self.world_size} ({allowed})."
            )
        if self.world_size % self.num_groups:
            raise ValueError(f"`num_groups={self.num_groups}` does not divide the world size {self.world_size}; "
                             f"allowed: {allowed}.")

    @property
    def group_size(self) -> int:
        return self.world_size // self.num_groups

    def group_of(self, rank: int) -> int:
        """The group index of a global rank."""
        return rank // self.group_size

    def ranks(self, group: int) -> list[int]:
        """The global ranks of one group."""
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def crosses_nodes(self, processes_per_node: int) -> bool:
        """Whether some group spans two nodes although a layout inside nodes was possible."""
        size = self.group_size
        return size < processes_per_node and processes_per_node % size != 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_layout(world_size: int, num_groups: Optional[int], multipliers: Optional[Sequence[float]]) -> GroupLayout:
    """The layout a strategy asked for: ``num_groups``, else one group per multiplier, else the world size's default
    (:func:`~lightning_hdet.hdet.rules.defaults.default_num_groups`: the largest divisor up to 4, one group per rank for a prime world size)."""
    groups = num_groups
    if groups is None and multipliers is not None:
        groups = len(multipliers)
        if world_size % groups:  # the user gave multipliers, not a group count: name what they wrote
            *most, last = map(str, divisors(world_size))
            allowed = f"{', '.join(most)} or {last}" if most else last
            raise ValueError(
                f"`lr_multipliers` has {groups} values, one group each, but {groups} groups do not divide the world "
                f"size {world_size}: give {allowed} multipliers, or run on a multiple of {groups} processes."
            )
    if groups is None:
        groups = default_num_groups(world_size)
    layout = GroupLayout(world_size, groups)
    if multipliers is not None and len(multipliers) != groups:
        raise ValueError(
            f"`lr_multipliers` has {len(multipliers)} values for {groups} groups; give exactly one multiplier per group."
        )
    return layout
