"""How the data-parallel ranks are split into HDET groups (pure: no process groups here).

Groups are contiguous blocks of equal size. Ranks are numbered node by node, so a group stays inside one node
whenever the group size divides the number of processes per node, keeping its gradient traffic local.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_hdet.fanout import check_num_groups


@dataclass(frozen=True)
class GroupLayout:
    """The split of ``world_size`` ranks into ``num_groups`` contiguous groups of equal size."""

    world_size: int
    num_groups: int

    def __post_init__(self) -> None:
        check_num_groups(self.num_groups)
        if self.num_groups > self.world_size:
            raise ValueError(
                f"`num_groups={self.num_groups}` is larger than the number of ranks ({self.world_size}); "
                f"allowed: a divisor of {self.world_size} ({', '.join(map(str, divisors(self.world_size)))})."
            )
        if self.world_size % self.num_groups:
            raise ValueError(
                f"`num_groups={self.num_groups}` does not divide the world size {self.world_size}; "
                f"allowed: {', '.join(map(str, divisors(self.world_size)))}."
            )

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
