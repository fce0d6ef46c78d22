"""What every HDET strategy shares, whatever it does with the model: groups and their learning rates.

:class:`HDETGroups` is a mixin for a Lightning data-parallel strategy (``"hdet"`` on DDP, ``"hdet_fsdp"`` on
FSDP2). It validates ``num_groups`` / ``lr_multipliers`` / ``spread`` / ``gradient_sync`` before any process exists,
splits the ranks into groups, owns the table of learning-rate multipliers, applies this rank's row around every
optimizer step (so schedulers never see it) and gathers one row of numbers per group. The host strategy provides
``optimizers``, ``world_size``, ``global_rank``, ``root_device``, ``num_nodes`` and ``num_processes``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import check_choice, require
from lightning_hdet._compat import unwrap_optimizer
from lightning_hdet.hdet.layout import GroupLayout, check_multipliers, check_num_groups, check_spread, fan_out

GradientSync = Literal["global", "group"]
GRADIENT_SYNC = ("global", "group")


class HDETGroups:
    """Groups of ranks, their learning-rate multipliers, and the one small collective every vote needs."""

    # set by the host strategy (Lightning's ParallelStrategy)
    optimizers: list[Optimizer]
    world_size: int
    global_rank: int
    root_device: torch.device
    num_nodes: int
    num_processes: int

    def _init_groups(
        self,
        num_groups: Optional[int],
        lr_multipliers: Optional[Sequence[float]],
        spread: float,
        gradient_sync: GradientSync,
    ) -> None:
        """Validate and keep the group settings (call first in the strategy's ``__init__``)."""
        if num_groups is not None:
            check_num_groups(num_groups)
        check_spread(spread)
        check_choice("gradient_sync", gradient_sync, GRADIENT_SYNC)
        if lr_multipliers is not None:
            lr_multipliers = check_multipliers(lr_multipliers)
            require("lr_multipliers", lr_multipliers, num_groups is None or len(lr_multipliers) == num_groups,
                    f"one multiplier per group (num_groups={num_groups})")
        self._requested_groups = num_groups
        self._requested_multipliers = lr_multipliers
        self.spread = spread
        self.gradient_sync = gradient_sync
        self._layout: Optional[GroupLayout] = None
        self._multipliers: Optional[Tensor] = None  # [num_groups, num_param_groups], float64 on the host

    @property
    def config(self) -> dict[str, Any]:
        """The HDET settings, as recorded in the logger's run config under ``hdet/...``."""
        return {
            "num_groups": self.num_groups,
            "group_size": self.layout.group_size,
            "lr_multipliers": self.lr_multipliers[:, 0].tolist(),
            "spread": self.spread,
            "gradient_sync": self.gradient_sync,
        }

    # ------------------------------------------------------------------ layout
    def _make_layout(self, world_size: int) -> GroupLayout:
        if world_size == 1:
            rank_zero_warn(
                f"{type(self).__name__} needs several data-parallel replicas to form groups; with a single process "
                "it trains as plain Lightning would (one group, multiplier 1)."
            )
            self._requested_multipliers = None
            self.spread = 0.0
            return GroupLayout(1, 1)
        groups = self._requested_groups
        if groups is None:
            groups = len(self._requested_multipliers) if self._requested_multipliers is not None else world_size
        layout = GroupLayout(world_size, groups)
        if self._requested_multipliers is not None and len(self._requested_multipliers) != groups:
            raise ValueError(
                f"`lr_multipliers` has {len(self._requested_multipliers)} values for {groups} groups; "
                "give exactly one multiplier per group."
            )
        if self.num_nodes > 1 and layout.crosses_nodes(self.num_processes):
            rank_zero_warn(
                f"HDET groups of {layout.group_size} ranks straddle nodes of {self.num_processes} processes; "
                "choose `num_groups` so the group size divides the processes per node to keep traffic local."
            )
        return layout

    @property
    def layout(self) -> GroupLayout:
        if self._layout is None:
            self._layout = self._make_layout(self.world_size)
        return self._layout

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def group_index(self) -> int:
        """The group this rank belongs to."""
        return self.layout.group_of(self.global_rank)

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's group."""
        return self.layout.ranks(self.group_index)

    # ------------------------------------------------------------------ learning-rate multipliers
    def _initial_multipliers(self) -> list[float]:
        if self._requested_multipliers is not None:
            return list(self._requested_multipliers)
        return fan_out(self.num_groups, self.spread)

    @property
    def lr_multipliers(self) -> Tensor:
        """Every group's multiplier for every optimizer param group: shape ``(num_groups, num_param_groups)``.

        Param groups added during training (e.g. by fine-tuning callbacks) start with their group's first
        multiplier.
        """
        if self._multipliers is None:
            self._multipliers = torch.tensor(self._initial_multipliers(), dtype=torch.float64)[:, None]
        missing = self.num_param_groups - self._multipliers.shape[1]
        if missing > 0:
            self._multipliers = torch.cat([self._multipliers, self._multipliers[:, :1].expand(-1, missing)], dim=1)
        return self._multipliers.clone()

    @property
    def lr_multiplier(self) -> float:
        """This rank's multiplier for the first param group."""
        return float(self.lr_multipliers[self.group_index, 0])

    def set_lr_multipliers(self, multipliers: Union[Sequence[float], Sequence[Sequence[float]], Tensor]) -> None:
        """Set every group's learning-rate multiplier: ``G`` values (all param groups alike) or a ``G x P`` table.

        This is the one place multipliers change at run time; call it with identical values on every rank.
        """
        table = torch.as_tensor(multipliers, dtype=torch.float64).clone()
        if table.dim() == 1:
            table = table[:, None].expand(-1, max(self.num_param_groups, 1)).clone()
        if table.dim() != 2 or table.shape[0] != self.num_groups:
            raise ValueError(
                f"`multipliers` must have one row per group ({self.num_groups}), got shape {tuple(table.shape)}."
            )
        if not bool(torch.isfinite(table).all()) or bool((table <= 0).any()):
            raise ValueError(f"`multipliers` must be positive and finite, got {table.tolist()}.")
        self._multipliers = table

    def param_group_offset(self, optimizer: Optimizer) -> int:
        """Index of ``optimizer``'s first param group in the flattened list over all optimizers."""
        offset = 0
        for opt in self.optimizers:
            if unwrap_optimizer(opt) is unwrap_optimizer(optimizer):
                return offset
            offset += len(opt.param_groups)
        raise ValueError("The optimizer is not one of the strategy's optimizers.")

    @property
    def num_param_groups(self) -> int:
        return sum(len(opt.param_groups) for opt in self.optimizers)

    @contextmanager
    def scaled_lr(self, optimizer: Optimizer) -> Iterator[None]:
        """Multiply each param group's ``lr`` by this group's multiplier for the duration of one step."""
        offset = self.param_group_offset(optimizer)
        row = self.lr_multipliers[self.group_index]
        saved = [pg["lr"] for pg in optimizer.param_groups]
        try:
            for i, pg in enumerate(optimizer.param_groups):
                pg["lr"] = pg["lr"] * float(row[offset + i])
            yield
        finally:
            for pg, lr in zip(optimizer.param_groups, saved):
                pg["lr"] = lr

    def schedule_lrs(self) -> Tensor:
        """The learning rate the optimizers and schedulers say, per flattened param group (no multiplier)."""
        return torch.tensor([float(pg["lr"]) for opt in self.optimizers for pg in opt.param_groups], dtype=torch.float64)

    def current_lrs(self) -> Tensor:
        """Real learning rate of every group and flattened param group: schedule LR x multiplier, ``(G, P)``."""
        return self.lr_multipliers * self.schedule_lrs()

    def _check_numeric_lrs(self) -> None:
        """Every param group must have a numeric ``lr`` for the multipliers to scale (call after the optimizers exist)."""
        for i, opt in enumerate(self.optimizers):
            for j, pg in enumerate(opt.param_groups):
                lr = pg.get("lr")
                if isinstance(lr, Tensor):
                    lr = float(lr)
                if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr):
                    raise ValueError(
                        f"{type(self).__name__} scales each param group's `lr`, but optimizer {i} "
                        f"({type(unwrap_optimizer(opt)).__name__}) param group {j} has lr={pg.get('lr')!r}; "
                        "use an optimizer with a numeric learning rate."
                    )

    # ------------------------------------------------------------------ the vote's collective
    def gather_group_values(self, values: Tensor) -> Tensor:
        """Sum ``values`` (1-D, this rank's numbers) over the ranks of each group; return ``(num_groups, k)``.

        One small all-reduce over all ranks; every rank gets every group's row.
        """
        values = values.to(self.root_device, torch.float64).reshape(-1)
        table = torch.zeros(self.num_groups, values.numel(), dtype=torch.float64, device=self.root_device)
        table[self.group_index] = values
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(table)
        return table.cpu()
