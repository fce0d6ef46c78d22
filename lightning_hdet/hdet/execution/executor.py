"""What :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` needs from a strategy: its ``hdet``, an
:class:`HDETParts`.

The callback (through its :class:`~lightning_hdet.hdet.rules.controller.HDETController`) *decides*; the strategy
*executes*, through four objects it owns and hands over as one :class:`HDETParts` (``strategy.hdet``):

* ``groups`` (:class:`~lightning_hdet.hdet.execution.comm.GroupComm`): the layout, this rank's group, the vote's one
  all-reduce (``gather_group_values``), over an injected communicator;
* ``table`` (:class:`~lightning_hdet.hdet.execution.rates.LearningRates`): every group's multipliers (the one writer at
  run
  time: ``set``), the schedule and the real learning rates;
* ``merger`` (:class:`~lightning_hdet.hdet.execution.merge.Merger`): merges, the restore point, roll-backs, the
  validation swap, over what the strategy's ranks hold (a :class:`~lightning_hdet.hdet.execution.merge.MergeSite`) and
  ``groups``;
* ``guard`` (:class:`~lightning_hdet.hdet.execution.guard.StepGuard`): the non-finite step check and its counter.

Besides them the callback calls the strategy's gradient switch (``set_gradient_sync``), reads its ``config`` and
the explored hyperparameters' tables (``explored``/``set_explored``),
and checkpoints the ensemble (:meth:`HDETParts.save_ensemble` / :meth:`HDETParts.load_ensemble`). Another strategy
plugs in by building these objects; :class:`~lightning_hdet.testing.FakeWorld` builds the same ones in memory.

Each piece of state has one owner: the strategy owns the process groups, the multiplier tables (the LR's in
``table``, the other explored hyperparameters' behind ``explored``/``set_explored``), the skipped-step
counter and the gradient hook (``guard``), the restore point (``merger``) and the groups' parameters and optimizer
states; the callback owns the loss accumulators, the vote's timing and logs; its controller owns the vote rule's
state, the permutation generator and the vote counters. Every collective is called on every rank with identical
arguments, in the same order.
"""

from __future__ import annotations

from typing import Any, Protocol

from lightning_utilities.core.rank_zero import rank_zero_warn  # what Lightning re-exports; execution/ imports no Lightning

from lightning_hdet.hdet.clusters import singletons
from lightning_hdet.hdet.execution.comm import GroupComm
from lightning_hdet.hdet.execution.guard import StepGuard
from lightning_hdet.hdet.execution.merge import Merger
from lightning_hdet.hdet.execution.rates import LearningRates
from lightning_hdet.hdet.hyperparams import Explored


class HDETHost(Protocol):
    """What only the strategy itself can do: switch how gradients are averaged, describe itself, name its files,
    hold the other explored hyperparameters' tables (``explore``)."""

    @property
    def gradient_sync(self) -> str:
        """``"global"`` (gradients averaged over all ranks) or ``"group"`` (inside each group)."""

    def set_gradient_sync(self, gradient_sync: Any) -> None:
        """Average gradients over all ranks or inside each group from the next step on (a collective)."""

    @property
    def clusters(self) -> list[list[int]]:
        """The groups that average one gradient (:mod:`~lightning_hdet.hdet.clusters`)."""

    def set_clusters(self, clusters: list[list[int]]) -> None:
        """Under ``gradient_sync="cluster"``, the clusters from the next step on (may create process groups)."""

    def rate_rows(self) -> Any:
        """Every group's multipliers beside its explored values, one row per group."""

    @property
    def config(self) -> dict[str, Any]:
        """The strategy's settings, recorded in the run config under ``hdet/...``."""

    def ensemble_files(self) -> dict[str, Any]:
        """The keys of ``checkpoint["hdet"]`` that say where every group's own state is."""

    @property
    def explored(self) -> Explored:
        """The other explored hyperparameters' tables (copies), what the optimizers say, and whether the LR is
        explored (:mod:`~lightning_hdet.hdet.hyperparams`; empty tables: the LR alone)."""

    def set_explored(self, tables: Any) -> None:
        """Replace the explored hyperparameters' tables (the only writer; applied around every later step)."""


class HDETParts:
    """The HDET side of one rank's strategy, as the callback drives it (see the module docstring)."""

    def __init__(self, host: HDETHost, groups: GroupComm, table: LearningRates, merger: Merger,
                 guard: StepGuard) -> None:
        self.host = host
        self.groups = groups
        self.table = table
        self.merger = merger
        self.guard = guard

    @property
    def num_groups(self) -> int:
        return self.groups.layout.num_groups

    @property
    def gradient_sync(self) -> str:
        return self.host.gradient_sync

    def set_gradient_sync(self, gradient_sync: str) -> None:
        """See :meth:`HDETHost.set_gradient_sync`."""
        self.host.set_gradient_sync(gradient_sync)

    @property
    def clusters(self) -> list[list[int]]:
        return self.host.clusters

    def set_clusters(self, clusters: list[list[int]]) -> None:
        """See :meth:`HDETHost.set_clusters`."""
        self.host.set_clusters(clusters)

    def rate_rows(self) -> Any:
        return self.host.rate_rows()

    @property
    def config(self) -> dict[str, Any]:
        return self.host.config

    @property
    def explored(self) -> Explored:
        """See :attr:`HDETHost.explored`."""
        return self.host.explored

    def set_explored(self, tables: Any) -> None:
        """See :meth:`HDETHost.set_explored`."""
        self.host.set_explored(tables)

    def sync_metrics_in_groups(self, on: bool) -> None:
        """While ``on``, a metric logged with ``sync_dist=True`` is reduced over this rank's group only (the Trainer's
        strategies: :class:`~lightning_hdet.hdet.lightning.metric_sync.GroupMetricSync`; a host without a Lightning ``reduce``
        has nothing to switch)."""
        if hasattr(self.host, "group_metrics"):
            self.host.group_metrics = on

    def validate_in_groups(self, on: bool) -> None:
        """Whether a fit's validation is split over each group's ranks only, so that every group validates the same
        data (:class:`~lightning_hdet.hdet.lightning.metric_sync.GroupMetricSync`; set before the fit builds its
        validation data; a host without Lightning's samplers has nothing to switch)."""
        if hasattr(self.host, "group_validation"):
            self.host.group_validation = on

    def save_ensemble(self, interval_row: Any) -> dict[str, Any]:
        """What a checkpoint keeps of the ensemble (``checkpoint["hdet"]``): multipliers, this rank's restore point,
        where every group's own state is (each group writes its own), every group's ``interval_row`` (the vote's
        interval so far) and the other explored hyperparameters' tables."""
        explored = self.explored.tables
        return {"num_groups": self.num_groups, "interval": self.groups.gather_group_values(interval_row),
                "lr_multipliers": self.table.multipliers, **self.host.ensemble_files(),
                "last_good": self.merger.restore_point, **({"explored": explored} if explored else {}),
                **({"clusters": self.clusters} if self.gradient_sync == "cluster" else {})}

    def load_ensemble(self, state: dict[str, Any]) -> Any:
        """Inverse of :meth:`save_ensemble` (the groups' own states are read when Lightning restores the model);
        returns the saved interval table, or ``None`` for a checkpoint of another number of groups (ignored)."""
        if not state or state.get("num_groups") != self.num_groups:
            return None
        self.table.set(state["lr_multipliers"])
        if state.get("last_good") is not None:
            self.merger.load_restore_point(state["last_good"])
        if self.gradient_sync == "cluster":  # (a checkpoint without clusters: every group alone, whatever it holds)
            self.set_clusters(state.get("clusters") or singletons(self.num_groups))
        if state.get("explored") is not None:  # (refused, naming both, when the run explores other names)
            self.set_explored(state["explored"])
        elif self.explored.tables:
            rank_zero_warn(f"The checkpoint holds no tables of the explored hyperparameters "
                           f"{list(self.explored.tables)} (its run explored the LR alone): they start from "
                           "`explore`'s initial multipliers.")
        return state["interval"]


def is_executor(strategy: Any) -> bool:
    """Whether ``strategy`` is one HDETCallback can drive: it carries an :class:`HDETParts` as ``hdet``
    (:class:`~lightning_hdet.hdet.lightning.strategy.HDETStrategy`, :class:`~lightning_hdet.hdet.fsdp.strategy.HDETFSDPStrategy`, the
    Fabric strategy, a :class:`~lightning_hdet.testing.FakeWorld`'s rank)."""
    return isinstance(getattr(strategy, "hdet", None), HDETParts)
