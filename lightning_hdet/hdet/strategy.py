"""HDETStrategy: data-parallel replicas split into groups that train with different learning rates.

A thin subclass of Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`. It adds

* one process group per HDET group (created identically on every rank, destroyed in ``teardown``),
* a per-group learning-rate multiplier applied around every optimizer step, so the scheduler never sees it,
* the executor side of :class:`~lightning_hdet.hdet.executor.HDETExecutor`, which the
  :class:`~lightning_hdet.hdet.callback.HDETCallback` drives: gathering one row of numbers per group, merging
  (blending) the groups' parameters in 25 MiB buckets, rolling back to a restore point,
* an optional guard that flags, on the device, the optimizer steps of a group whose loss or gradients are
  non-finite (skipped on the device by fused optimizers),
* checkpoints whose ``state_dict`` is the merged model, plus one file per group with its own state.
"""

from __future__ import annotations

import atexit
import inspect
import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Literal, Optional, Union

import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._compat import (
    StrategyRegistry,
    ddp_process_group,
    ensure_callback,
    has_user_comm_hook,
    register_names,
    set_ddp_process_group,
    strategy_timeout,
    sync_module_states,
    unwrap_optimizer,
)
from lightning_hdet.hdet.ensemble import EnsembleOps
from lightning_hdet.hdet.guard import FiniteGuard, NonFiniteSteps, skips_on_device
from lightning_hdet.hdet.layout import GroupLayout, check_multipliers, check_num_groups, check_spread, fan_out, make_layout
from lightning_hdet.hdet.multipliers import (
    MultiplierTable,
    check_numeric_lrs,
    param_group_offset,
    scaled_lr,
    schedule_lrs,
)
from typing_extensions import override

log = logging.getLogger(__name__)

GradientSync = Literal["global", "group"]
_GRADIENT_SYNC = ("global", "group")
# Extra keyword arguments DDPStrategy forwards to torch's DistributedDataParallel; HDET owns `process_group`.
_DDP_KWARGS = tuple(sorted(set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "process_group"}))


class HDETStrategy(EnsembleOps, DDPStrategy):
    """Data parallelism with groups of replicas that train with different learning rates.

    Args:
        num_groups: number of groups (the ensemble's members). ``None``: one group per rank (the published setting).
            Ranks are split into contiguous groups of equal size.
        lr_multipliers: one learning-rate multiplier per group, applied to every learning rate the optimizer and
            schedulers produce. ``None``: the symmetric fan-out set by ``spread``.
        spread: half-width of the published fan-out ``1 + spread * (g - (G-1)/2) / max((G-1)/2, 0.5)``, in ``[0, 1)``.
            ``0`` is plain DDP.
        gradient_sync: ``"global"``: gradients averaged over all ranks every step (published; groups differ only in
            step size). ``"group"``: each group is its own DDP job on its own process group, so groups diverge
            between merges.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` accepts.

    The executor interface (:class:`~lightning_hdet.hdet.executor.HDETExecutor`), through which the callback and
    nothing else drives HDET; the strategy owns the state behind it (call on every rank, same arguments):

    * read-outs: ``layout``, ``num_groups``, ``group_index``, ``gradient_sync``, ``root_device``, ``config``,
      ``lr_multipliers`` (a copy), ``schedule_lrs()``, ``current_lrs()``;
    * ``set_lr_multipliers(table)``: the one writer of the multiplier table;
    * ``enable_guard()``: turn the non-finite step guard on; the callback calls it from ``setup(stage="fit")``,
      before the model is wrapped (the guard is a DDP communication hook);
    * ``interval_skipped(reset=True)``: flagged steps since the last reset (the total: ``skipped_steps``);
    * ``gather_group_values(values)``: one small all-reduce, every group's row on every rank;
    * ``add_init_noise(relative_std, seed)``: the published warm start;
    * ``merge(coefficients, strengths, restart)``, ``ensure_restore_point()``, ``restore()``: blend, keep the last
      finite target on the host, roll back to it;
    * ``save_ensemble()`` / ``load_ensemble(state)``: the ensemble part of a checkpoint.
    """

    strategy_name = "hdet"

    def __init__(
        self,
        num_groups: Optional[int] = None,
        lr_multipliers: Optional[Sequence[float]] = None,
        spread: float = 1 / 9,
        gradient_sync: GradientSync = "global",
        **kwargs: Any,
    ) -> None:
        if num_groups is not None:
            check_num_groups(num_groups)
        check_spread(spread)
        if gradient_sync not in _GRADIENT_SYNC:
            raise ValueError(f"`gradient_sync` must be one of {_GRADIENT_SYNC}, got {gradient_sync!r}.")
        if lr_multipliers is not None:
            lr_multipliers = check_multipliers(lr_multipliers)
            if num_groups is not None and len(lr_multipliers) != num_groups:
                raise ValueError(
                    f"`lr_multipliers` has {len(lr_multipliers)} values but `num_groups={num_groups}`; "
                    "give exactly one multiplier per group."
                )
        _check_ddp_kwargs(kwargs)
        super().__init__(**kwargs)
        self._requested_groups = num_groups
        self._requested_multipliers = lr_multipliers
        self.spread = spread
        self.gradient_sync = gradient_sync
        self._layout: Optional[GroupLayout] = None
        self._group_pgs: list[Any] = []
        self._multipliers: Optional[MultiplierTable] = None
        self._guard_enabled = False
        self._guard: Optional[FiniteGuard] = None
        self._steps: Optional[NonFiniteSteps] = None  # flags and counts non-finite steps on the device
        self._restore_point: Optional[Tensor] = None  # owned by EnsembleOps

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"hdet"`` (subprocess launcher) and ``"hdet_spawn"`` without replacing existing entries."""
        register_names(strategy_registry, cls, [
            (name, f"HDET strategy with `start_method` '{method}'", {"start_method": method})
            for name, method in (("hdet", "popen"), ("hdet_spawn", "spawn"))
        ])

    @override
    def connect(self, model: LightningModule) -> None:
        """Attach the model; install a default :class:`~lightning_hdet.hdet.callback.HDETCallback` if none was passed."""
        super().connect(model)
        from lightning_hdet.hdet.callback import HDETCallback  # the callback imports this module

        ensure_callback(model, HDETCallback)

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

    # ------------------------------------------------------------------ layout and process groups
    @override
    def _configure_launcher(self) -> None:
        # Runs when the Trainer is built, before any process or process group exists: validate the layout here.
        self._layout = self._make_layout(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _make_layout(self, world_size: int) -> GroupLayout:
        if world_size == 1:
            rank_zero_warn(
                "HDETStrategy needs several data-parallel replicas to form groups; with a single process it trains "
                "as plain Lightning would (one group, multiplier 1)."
            )
            self._requested_multipliers = None
            self.spread = 0.0
            return GroupLayout(1, 1)
        layout = make_layout(world_size, self._requested_groups, self._requested_multipliers)
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

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        rank_zero_info(f"HDET: creating {self.layout.num_groups} process groups of {self.layout.group_size} ranks")
        # Every rank must create every group, in the same order.
        self._group_pgs = [
            dist.new_group(self.layout.ranks(g), timeout=strategy_timeout(self)) for g in range(self.layout.num_groups)
        ]
        # Lightning destroys the default group at exit for NCCL only; a gloo group still alive while the interpreter
        # finalizes can abort the process ("terminate called without an active exception"): destroy it first.
        atexit.unregister(_destroy_default_group)  # once per process, however many fits
        atexit.register(_destroy_default_group)

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

    @property
    def group_process_group(self) -> Any:
        """The process group of this rank's group (``None`` before the distributed setup)."""
        return self._group_pgs[self.group_index] if self._group_pgs else None

    # ------------------------------------------------------------------ learning-rate multipliers
    @property
    def _table(self) -> MultiplierTable:
        if self._multipliers is None:
            initial = self._requested_multipliers
            if initial is None:
                initial = fan_out(self.num_groups, self.spread)
            self._multipliers = MultiplierTable(initial)
        return self._multipliers

    @property
    def lr_multipliers(self) -> Tensor:
        """Every group's multiplier for every optimizer param group: shape ``(num_groups, num_param_groups)``.

        Param groups added during training (e.g. by fine-tuning callbacks) start with their group's first
        multiplier.
        """
        return self._table.get(self.num_param_groups)

    @property
    def lr_multiplier(self) -> float:
        """This rank's multiplier for the first param group."""
        return float(self.lr_multipliers[self.group_index, 0])

    def set_lr_multipliers(self, multipliers: Union[Sequence[float], Sequence[Sequence[float]], Tensor]) -> None:
        """Set every group's learning-rate multiplier: ``G`` values (all param groups alike) or a ``G x P`` table.

        This is the one place multipliers change at run time; call it with identical values on every rank.
        """
        self._table.set(multipliers, self.num_groups, self.num_param_groups)

    def param_group_offset(self, optimizer: Optimizer) -> int:
        """Index of ``optimizer``'s first param group in the flattened list over all optimizers."""
        return param_group_offset([unwrap_optimizer(o) for o in self.optimizers], unwrap_optimizer(optimizer))

    @property
    def num_param_groups(self) -> int:
        return sum(len(opt.param_groups) for opt in self.optimizers)

    def scaled_lr(self, optimizer: Optimizer) -> AbstractContextManager[None]:
        """Multiply each param group's ``lr`` by this group's multiplier for the duration of one step."""
        offset = self.param_group_offset(optimizer)
        row = self._table.row(self.group_index, self.num_param_groups)
        return scaled_lr(optimizer, row[offset : offset + len(optimizer.param_groups)])

    def schedule_lrs(self) -> Tensor:
        """The learning rate the optimizers and schedulers say, per flattened param group (no multiplier)."""
        return schedule_lrs(self.optimizers)

    def current_lrs(self) -> Tensor:
        """Real learning rate of every group and flattened param group: schedule LR x multiplier, ``(G, P)``."""
        return self.lr_multipliers * self.schedule_lrs()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        check_numeric_lrs([unwrap_optimizer(opt) for opt in self.optimizers])

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self._steps is None:  # guard off
            with self.scaled_lr(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        inner = unwrap_optimizer(optimizer)
        scaler = self._uses_grad_scaler()  # a GradScaler skips non-finite steps itself and owns ``found_inf``
        exact = skips_on_device(inner) and not scaler
        closure = self._steps.wrap(closure, optimizer, self._guard, not scaler, self.group_process_group,
                                   self.layout.group_size, exact)
        try:
            with self.scaled_lr(optimizer), (self._steps.found_inf(inner) if exact else nullcontext()):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if self._guard is not None:
                self._guard.reset()

    # ------------------------------------------------------------------ safety net: non-finite steps
    def enable_guard(self) -> None:
        """Flag the optimizer steps whose loss or gradients are non-finite, and skip them where the optimizer can
        do so on the device (see :class:`~lightning_hdet.hdet.guard.NonFiniteSteps`); call before wrapping."""
        self._guard_enabled = True

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the guard flagged on this rank since this strategy started (reads the device counter)."""
        return self._steps.total() if self._steps is not None else 0

    def interval_skipped(self, reset: bool = True) -> int:
        """Flagged steps since the last reset (or the start of fit); ``reset=False`` only peeks. One host read of
        the device counter: called at votes and checkpoints, never per step."""
        return self._steps.interval(reset) if self._steps is not None else 0

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.interval_skipped(reset=True)  # a vote interval starts with the fit

    def _uses_grad_scaler(self) -> bool:
        return isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None

    # ------------------------------------------------------------------ DDP wrapping
    @override
    def _setup_model(self, model: Module) -> Module:
        if self.gradient_sync == "group":
            # Groups are separate DDP jobs: start them all from rank 0's weights, then reduce inside the group.
            sync_module_states(model)
            set_ddp_process_group(self, self.group_process_group)
        return super()._setup_model(model)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self._guard_enabled and self._steps is None:
            self._steps = NonFiniteSteps(self.root_device)
        if self._guard_enabled and not has_user_comm_hook(self) and not self._uses_grad_scaler():
            pg = ddp_process_group(self)
            self._guard = FiniteGuard(pg, dist.get_world_size(pg), self.root_device)
            self.model.register_comm_hook(self._guard, FiniteGuard.hook)  # type: ignore[union-attr]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's reader, with a clear error for a truncated or corrupted file; adds this group's own state."""
        checkpoint = read_checkpoint(
            lambda: super(HDETStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
            checkpoint_path)
        self.attach_own_state(checkpoint, checkpoint_path, weights_only)
        return checkpoint

    @override
    def teardown(self) -> None:
        self._guard = None  # (the step counter stays: ``skipped_steps`` is read after the fit)
        # HDET's groups are destroyed before Lightning's teardown, while the default group they were built on is up.
        for pg in self._group_pgs:
            dist.destroy_process_group(pg)
        self._group_pgs = []
        super().teardown()


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Reject keyword arguments that DistributedDataParallel would only refuse after the process groups exist.

    Sharded strategies' options (FSDP's ``sharding_strategy``, DeepSpeed's ``stage``/``offload_optimizer``, ...)
    land here: HDET needs a full model replica on every rank, because groups merge by averaging whole parameters.
    """
    own = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    for name in kwargs:
        if name == "process_group":
            if kwargs[name] is not None:
                raise ValueError(
                    "`process_group` cannot be passed to HDETStrategy: it creates the process groups itself "
                    "(one per HDET group)."
                )
        elif name not in own and name not in _DDP_KWARGS:
            raise ValueError(
                f"HDETStrategy got an unsupported argument `{name}`={kwargs[name]!r}. Besides its own and "
                f"DDPStrategy's arguments it accepts only DistributedDataParallel options: {', '.join(_DDP_KWARGS)}. "
                "Sharded training (FSDP/DeepSpeed options) is not supported: every rank holds a full replica."
            )
