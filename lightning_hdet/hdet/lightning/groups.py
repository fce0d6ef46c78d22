"""What every HDET strategy shares, whatever it does with the model: groups, learning rates, skipped steps.

:class:`HDETGroups` is mixed into both HDET strategies (``"hdet"`` on DDP, ``"hdet_fsdp"`` on FSDP2), before the
Lightning base class. It validates ``num_groups`` / ``lr_multipliers`` / ``spread`` / ``gradient_sync`` before
any process exists, splits the ranks into groups, owns the multiplier table and applies this rank's row around
every optimizer step (so schedulers never see it), owns the non-finite step check (flags and counts on the device:
no host sync per step), and builds the objects the callback drives
(:class:`~lightning_hdet.hdet.execution.executor.HDETParts`, ``self.hdet``): the groups' collectives, the learning
rates, the merger and the step guard.

A host strategy provides Lightning's ``optimizers``, ``world_size``, ``global_rank``, ``root_device``,
``num_nodes``, ``num_processes``, ``precision_plugin``, and ``_guard_process_group`` (the ranks that skip a step
together); it sets ``self.hdet.guard.hook`` to the state of the gradient hook it installs (whose ``flag`` says a
local gradient was not finite), if any.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Literal, Optional, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_choice, require
from lightning_hdet._compat import ensure_callback, unwrap_optimizer
from lightning_hdet._launch import handing_back
from lightning_hdet.hdet.clusters import equal_rows, stacked_rows
from lightning_hdet.hdet.execution.comm import Communicator, GroupComm, ProcessGroupCommunicator
from lightning_hdet.hdet.execution.executor import HDETParts
from lightning_hdet.hdet.execution.guard import StepGuard, skips_on_device
from lightning_hdet.hdet.execution.merge import Merger, MergeSite
from lightning_hdet.hdet.execution.rates import LearningRates
from lightning_hdet.hdet.hyperparams import Explored, ExploredTables, Span, check_explore, check_optimizers, scaled
from lightning_hdet.hdet.hyperparams import bases as explored_bases
from lightning_hdet.hdet.layout import (
    GroupLayout,
    check_multipliers,
    check_num_groups,
    check_spread,
    initial_multipliers,
    make_layout,
)
from lightning_hdet.hdet.lightning.gradient_groups import GradientGroups
from lightning_hdet.hdet.multipliers import (
    MultiplierTable,
    check_numeric_lrs,
    param_group_offset,
    scaled_lr,
    schedule_lrs,
)
from lightning_hdet.hdet.rules.defaults import PRESETS, lone_ranks_warning

GradientSync = Literal["global", "group", "cluster"]
GRADIENT_SYNC = ("global", "group", "cluster")


class HDETGroups(GradientGroups):
    """Groups of ranks, their learning-rate multipliers, the guard's counters and the vote's one collective."""

    hdet: HDETParts

    def _init_groups(
        self,
        num_groups: Optional[int],
        lr_multipliers: Optional[Sequence[float]],
        spread: Optional[float],
        gradient_sync: Optional[GradientSync],
        preset: str = "recommended",
        explore: Optional[Mapping[str, Span]] = None,
    ) -> None:
        """Validate and keep the group settings (call first in the strategy's ``__init__``: no process exists yet).

        ``None`` for ``spread``/``gradient_sync`` takes the ``preset``'s (:mod:`~lightning_hdet.hdet.rules.defaults`);
        ``explore``: :mod:`~lightning_hdet.hdet.hyperparams`."""
        self._explore = check_explore(explore, num_groups, lr_multipliers is not None or spread is not None)
        self._explored: Optional[ExploredTables] = None
        if num_groups is not None:
            check_num_groups(num_groups)
        check_choice("preset", preset, tuple(PRESETS))
        self.preset = PRESETS[preset]
        if spread is not None:
            check_spread(spread)
            require("spread", spread, lr_multipliers is None, "None when `lr_multipliers` is given",
                    "`spread` only shapes the default multipliers; give one or the other.")
        gradient_sync = self.preset.gradient_sync if gradient_sync is None else gradient_sync
        check_choice("gradient_sync", gradient_sync, GRADIENT_SYNC)
        if lr_multipliers is not None:
            lr_multipliers = check_multipliers(lr_multipliers)
            if num_groups is not None and len(lr_multipliers) != num_groups:
                raise ValueError(
                    f"`lr_multipliers` has {len(lr_multipliers)} values but `num_groups={num_groups}`; "
                    "give exactly one multiplier per group."
                )
        self._requested_groups = num_groups
        self._requested_multipliers = lr_multipliers
        self.spread = spread if spread is not None or self.preset.span else self.preset.spread
        self.gradient_sync = gradient_sync
        self._layout: Optional[GroupLayout] = None
        self._multipliers: Optional[MultiplierTable] = None
        self._init_gradient_groups()

    def _init_parts(self, site: MergeSite, communicator: Optional[Communicator] = None) -> None:
        """Build ``self.hdet``, the objects the callback drives (call in ``__init__``, after :meth:`_init_groups`):
        every collective between the ranks goes through ``communicator`` (``None``: ``torch.distributed``, a
        :class:`~lightning_hdet.hdet.execution.comm.ProcessGroupCommunicator`), read back as :attr:`communicator`;
        ``site``
        says what this strategy's merges carry."""
        comm = ProcessGroupCommunicator() if communicator is None else communicator
        groups = GroupComm(self, comm)
        self.hdet = HDETParts(self, groups, LearningRates(self), Merger(site, groups), StepGuard(comm))

    @property
    def communicator(self) -> Communicator:
        """What every collective of this strategy's HDET code goes through (the ``communicator`` argument)."""
        return self.hdet.groups.comm

    @property
    def config(self) -> dict[str, Any]:
        """The HDET settings, as recorded in the logger's run config under ``hdet/...``."""
        return {
            "num_groups": self.num_groups,
            "group_size": self.layout.group_size,
            "lr_multipliers": self.lr_multipliers[:, 0].tolist(),
            "spread": self.spread,
            "preset": self.preset.name,
            "gradient_sync": self.gradient_sync,
            **({"clusters": self.clusters} if self.gradient_sync == "cluster" else {}),
            **({"explore": {n: t[:, 0].tolist() for n, t in self.explored.tables.items()}} if self._explore else {}),
        }

    @override
    def connect(self, model: LightningModule) -> None:
        """Attach the model; install a default :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` unless passed."""
        super().connect(model)  # type: ignore[misc]
        from lightning_hdet.hdet.lightning.callback import HDETCallback  # the callback imports the strategies

        ensure_callback(model, HDETCallback, lambda: HDETCallback(**self.preset.callback))

    # ------------------------------------------------------------------ layout
    @override
    def _configure_launcher(self) -> None:
        # Runs when the Trainer is built, before any process or process group exists: validate the layout here.
        self._layout = self._make_layout(self.num_nodes * self.num_processes)
        self._explored = ExploredTables(self._explore, self.num_groups)  # (a list of multipliers: one per group)
        if self.gradient_sync == "cluster" and all(len(c) == 1 for c in equal_rows(self.rate_rows())):
            rank_zero_warn(
                f"gradient_sync='cluster' with the multipliers {self._table.get(1)[:, 0].tolist()}: no two groups share "
                "their rates, so every group trains alone as under 'group'. Clusters need four groups or more (the "
                "default grid then puts the user's LR on the middle ones) or equal `lr_multipliers`."
            )
        super()._configure_launcher()  # type: ignore[misc]
        self._launcher = handing_back(self, self._launcher)  # hdet.result in a fork/spawn fit's launching process

    def _make_layout(self, world_size: int) -> GroupLayout:
        if world_size == 1:
            rank_zero_warn(
                f"{type(self).__name__} needs several data-parallel replicas to form groups; with a single process "
                "it trains as plain Lightning would (one group, multiplier 1)."
            )
            self._requested_multipliers = None
            self.spread = 0.0
            self._explore = {}  # (one group: nothing to explore, as for the LR)
            return GroupLayout(1, 1)
        groups = self._requested_groups
        if groups is None and self.preset.group_per_rank and self._requested_multipliers is None:
            groups = world_size  # the paper's members: one per rank, all sharing one gradient
        layout = make_layout(world_size, groups, self._requested_multipliers)
        if groups is None and self._requested_multipliers is None and (note := lone_ranks_warning(world_size)):
            rank_zero_warn(note)
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
    @property
    def _table(self) -> MultiplierTable:
        if self._multipliers is None:
            lr_span = self._explore.get("lr")
            self._multipliers = MultiplierTable(initial_multipliers(
                self.num_groups, self._requested_multipliers, self.spread,
                lr_span if isinstance(lr_span, float) else None, self.gradient_sync == "cluster", self.preset.span))
        return self._multipliers

    @property
    def multiplier_table(self) -> MultiplierTable:
        """The multiplier table this strategy applies around every step (read and written through ``hdet.table``)."""
        return self._table

    @property
    def lr_multipliers(self) -> Tensor:
        """Every group's multiplier for every optimizer param group: shape ``(num_groups, num_param_groups)``.

        Param groups added during training (e.g. by fine-tuning callbacks) start with their group's first
        multiplier.
        """
        return self.hdet.table.multipliers

    @property
    def lr_multiplier(self) -> float:
        """This rank's multiplier for the first param group."""
        return float(self.lr_multipliers[self.group_index, 0])

    def set_lr_multipliers(self, multipliers: Union[Sequence[float], Sequence[Sequence[float]], Tensor]) -> None:
        """Set every group's learning-rate multiplier: ``G`` values (all param groups alike) or a ``G x P`` table.

        This is the one place multipliers change at run time; call it with identical values on every rank.
        """
        self.hdet.table.set(multipliers)

    def set_gradient_sync(self, gradient_sync: GradientSync) -> None:
        """Average gradients over all ranks (``"global"``), inside each group (``"group"``) or inside each cluster
        (``"cluster"``, :attr:`clusters`) from the next step on.

        The one writer of ``gradient_sync`` after ``__init__``; call it on every rank at the same step, between
        steps. Every group keeps its own parameters; how the strategy switches is its ``_apply_gradient_sync``.
        """
        check_choice("gradient_sync", gradient_sync, GRADIENT_SYNC)
        if gradient_sync != self.gradient_sync:
            self.gradient_sync = gradient_sync
            self._apply_gradient_sync()

    def _apply_gradient_sync(self) -> None:
        """Make the wrapped or sharded model reduce gradients as ``gradient_sync`` now says (the strategy's hook)."""
        raise NotImplementedError

    def rate_rows(self) -> Tensor:
        """Every group's multipliers beside its explored hyperparameters' values, one row per group: groups with
        equal rows train alike."""
        columns = max(1, self.num_param_groups)  # (before the optimizers exist, every column is the first)
        tables = [self._table.get(columns), *(self._hyper.get(columns).values() if self._explore else ())]
        return stacked_rows(tables, self.num_groups)

    def param_group_offset(self, optimizer: Optimizer) -> int:
        """Index of ``optimizer``'s first param group in the flattened list over all optimizers."""
        return param_group_offset([unwrap_optimizer(o) for o in self.optimizers], unwrap_optimizer(optimizer))

    @property
    def num_param_groups(self) -> int:
        return sum(len(opt.param_groups) for opt in self.optimizers)

    def scaled_lr(self, optimizer: Optimizer) -> AbstractContextManager[None]:
        """Multiply each param group's ``lr`` by this group's multiplier for the duration of one step."""
        offset = self.param_group_offset(optimizer)
        row = self._table.row(self.group_index, self.num_param_groups)  # cached floats: nothing allocated per step
        lr = scaled_lr(optimizer, row[offset : offset + len(optimizer.param_groups)])
        if not self._explore:
            return lr
        rows = self._hyper.rows(self.group_index, self.num_param_groups, offset, len(optimizer.param_groups))
        return _together(lr, scaled(optimizer, rows))

    # ------------------------------------------------------------------ other explored hyperparameters
    @property
    def _hyper(self) -> ExploredTables:
        if self._explored is None:
            self._explored = ExploredTables(self._explore, self.num_groups)
        return self._explored

    @property
    def explored(self) -> Explored:
        """The other explored hyperparameters' tables (copies) and what the optimizers say
        (:mod:`~lightning_hdet.hdet.hyperparams`)."""
        if not self._explore:
            return Explored()
        tables = self._hyper.get(self.num_param_groups)
        return Explored(tables, explored_bases([unwrap_optimizer(o) for o in self.optimizers], list(tables)),
                        self._hyper.lr)

    def set_explored(self, tables: Mapping[str, Any]) -> None:
        """Replace the explored hyperparameters' tables (the one writer; identical values on every rank)."""
        self._hyper.set(tables, self.num_groups, self.num_param_groups)

    def schedule_lrs(self) -> Tensor:
        """The learning rate the optimizers and schedulers say, per flattened param group (no multiplier)."""
        return schedule_lrs(self.optimizers)

    def current_lrs(self) -> Tensor:
        """Real learning rate of every group and flattened param group: schedule LR x multiplier, ``(G, P)``."""
        return self.hdet.table.current_lrs()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)  # type: ignore[misc]
        check_numeric_lrs([unwrap_optimizer(opt) for opt in self.optimizers])
        check_optimizers([unwrap_optimizer(opt) for opt in self.optimizers], list(self._explore))

    # ------------------------------------------------------------------ the step, and the safety net's guard
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        guard = self.hdet.guard
        if not guard.enabled:
            with self.scaled_lr(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        steps, inner = guard.counter(self.root_device), unwrap_optimizer(optimizer)
        scaler = self._uses_grad_scaler()  # a GradScaler skips non-finite steps itself and owns ``found_inf``
        exact = skips_on_device(inner) and not scaler
        closure = steps.wrap(closure, optimizer, guard.hook, not scaler, *self._step_guard_group(), exact)
        try:
            with self.scaled_lr(optimizer), (steps.found_inf(inner) if exact else nullcontext()):
                return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        finally:
            if guard.hook is not None:
                guard.hook.reset()

    def _step_guard_group(self) -> tuple[Any, int]:
        """The ranks that skip a flagged step together, and how many: this rank's group (its strategy may widen it
        to the ranks that share its gradient)."""
        return self._guard_process_group, self.layout.group_size

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the guard flagged on this rank since this strategy started (reads the device counter)."""
        return self.hdet.guard.skipped_steps

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self.hdet.guard.interval_skipped(reset=True)  # a vote interval starts with the fit

    def _uses_grad_scaler(self) -> bool:
        return isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None



@contextmanager
def _together(first: AbstractContextManager[None], second: AbstractContextManager[None]) -> Iterator[None]:
    with first, second:
        yield
