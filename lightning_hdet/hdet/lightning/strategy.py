"""HDETStrategy: data-parallel replicas split into groups that train with different learning rates.

A thin subclass of Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`. It adds

* one process group per HDET group (created identically on every rank, destroyed in ``teardown``),
* a per-group learning-rate multiplier applied around every optimizer step, so the scheduler never sees it
  (shared with ``"hdet_fsdp"`` through :class:`~lightning_hdet.hdet.lightning.groups.HDETGroups`),
* the objects :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` drives (``strategy.hdet``,
  :class:`~lightning_hdet.hdet.execution.executor.HDETParts`): the groups' collectives (one row of numbers per group),
  the multiplier table, a merger (blending the groups' parameters in 25 MiB buckets, rolling back to a restore point),
* an optional guard that flags, on the device, the optimizer steps of a group whose loss or gradients are
  non-finite (skipped on the device by fused optimizers),
* checkpoints whose ``state_dict`` is the merged model, plus one file per group with its own state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._checks import check_names, own_arguments
from lightning_hdet._compat import (
    DDP_OPTIONS,
    StrategyRegistry,
    ddp_kwarg,
    has_user_comm_hook,
    register_names,
    set_ddp_kwarg,
    strategy_timeout,
    sync_module_states,
    unwrap_ddp,
    weights_only_kwargs,
)
from lightning_hdet._process_groups import destroy_default_group_at_exit, destroy_groups
from lightning_hdet._text import counted
from lightning_hdet.hdet.execution.comm import Communicator
from lightning_hdet.hdet.execution.guard import FiniteGuard
from lightning_hdet.hdet.hyperparams import Span
from lightning_hdet.hdet.lightning.ensemble import EnsembleOps, ReplicaSite
from lightning_hdet.hdet.lightning.groups import GradientSync, HDETGroups
from lightning_hdet.hdet.lightning.metric_sync import GroupMetricSync
from lightning_hdet.hdet.rules.defaults import DEFAULT_PRESET
from typing_extensions import override

log = logging.getLogger(__name__)

class HDETStrategy(GroupMetricSync, HDETGroups, EnsembleOps, DDPStrategy):
    """Data parallelism with groups of replicas that train with different learning rates.

    Args:
        num_groups: number of groups (the ensemble's members). ``None``: chosen from the world size (one group per
            rank up to 4 ranks, then the largest divisor up to 4: 6 ranks give 3 groups of 2, 8 give 4 of 2, 64 give
            4 of 16, a prime world size one group per rank (with a warning);
            :func:`~lightning_hdet.hdet.rules.defaults.default_num_groups`); ``preset="published"``: one group per rank.
            Ranks are split into contiguous groups of equal size.
        lr_multipliers: one learning-rate multiplier per group, applied to every learning rate the optimizer and
            schedulers produce. ``None``: the preset's (recommended: a geometric grid spanning 27x around the
            optimizer's LR, one group at 1x: ``0.44, 1, 2.3, 5.2`` with four groups), or the fan-out set by ``spread``.
        spread: half-width of the published fan-out ``1 + spread * (g - (G-1)/2) / max((G-1)/2, 0.5)``, in ``[0, 1)``
            (``0`` is plain DDP); ``None``: the preset's multipliers. Not with ``lr_multipliers``.
        gradient_sync: ``"group"``: each group is its own DDP job on its own process group, so groups diverge between
            merges (recommended for a search). ``"global"``: gradients averaged over all ranks every step (published;
            groups differ only in step size). ``"cluster"`` (experimental): as ``"group"``, but groups at equal
            rates that hold one model train as one DDP job (a cluster; the default grid puts the user's LR
            on the middle groups, :func:`~lightning_hdet.hdet.rules.defaults.incumbent_grid`), until a vote treats
            them differently (:mod:`~lightning_hdet.hdet.clusters`). ``None``: the preset's.
        preset: the defaults of the arguments left ``None`` and of the HDETCallback installed when none is passed
            (:mod:`~lightning_hdet.hdet.rules.defaults`): ``"recommended"`` (search, then train: the measured best) or
            ``"published"`` (the paper's: ``spread=1/9``, ``"global"``, ``vote="softmax"``, no end to the search).
        explore: other param-group hyperparameters the groups diverge in, each with its span (the ratio of the
            largest to the smallest multiplier) or one multiplier per group, e.g. ``{"weight_decay": 10.0}``;
            ``"momentum"``, ``"beta1"``, ``"beta2"`` are multiplied through ``1 - beta``; ``"lr"`` sets the LR's
            span (``1.0``: the LR is not explored). The votes move them as the LR
            (:mod:`~lightning_hdet.hdet.hyperparams`, docs/configuration.md). ``None``: the LR alone.
        communicator: what every HDET collective goes through
            (:class:`~lightning_hdet.hdet.execution.comm.Communicator`); ``None``: ``torch.distributed`` over the
            strategy's process groups.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` accepts.

    What the callback drives (``strategy.hdet``, an :class:`~lightning_hdet.hdet.execution.executor.HDETParts`): the
    groups' collectives (``groups``), the multiplier table (``table``), the merger (``merger``: merges, restore point,
    roll-backs, the validation swap) and the non-finite step guard (``guard``), objects the strategy owns; besides
    them only ``set_gradient_sync(mode)`` (DDP wraps the model again), ``config`` and the explored hyperparameters'
    tables (``explored`` / ``set_explored(tables)``, under ``explore``). A user reads ``layout``, ``num_groups``,
    ``group_index``, ``lr_multipliers`` (a copy), ``current_lrs()`` and ``skipped_steps`` here, and may replace the
    table with ``set_lr_multipliers(table)`` (on every rank, the same values).
    """

    strategy_name = "hdet"

    def __init__(
        self,
        num_groups: Optional[int] = None,
        lr_multipliers: Optional[Sequence[float]] = None,
        spread: Optional[float] = None,
        gradient_sync: Optional[GradientSync] = None,
        preset: str = DEFAULT_PRESET,
        explore: Optional[Mapping[str, Span]] = None,
        communicator: Optional[Communicator] = None,
        **kwargs: Any,
    ) -> None:
        _check_ddp_kwargs(type(self), kwargs)
        self._init_groups(num_groups, lr_multipliers, spread, gradient_sync, preset, explore)
        super().__init__(**kwargs)
        self._group_pgs: list[Any] = []
        self._cluster_size = 1
        self._init_parts(ReplicaSite(self), communicator)

    # ------------------------------------------------------------------ registration
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"hdet"`` (subprocess launcher), ``"hdet_spawn"`` and ``"hdet_published"`` (the paper's set-up,
        subprocess launcher) without replacing existing entries."""
        register_names(strategy_registry, cls, [
            (name, f"HDET strategy with `start_method` '{method}'", {"start_method": method})
            for name, method in (("hdet", "popen"), ("hdet_spawn", "spawn"))
        ] + [("hdet_published", "HDET as published (ALGORITHMS.md §1)", {"preset": "published"})])

    # ------------------------------------------------------------------ process groups
    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        module = self.lightning_module
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:  # validate, test: the same again
            rank_zero_info(f"HDET: creating {counted(self.layout.num_groups, 'process group')} of "
                           f"{counted(self.layout.group_size, 'rank')} each")
        self._group_pgs = self._new_group_process_groups(strategy_timeout(self))
        destroy_default_group_at_exit()

    @property
    def group_process_group(self) -> Any:
        """The process group of this rank's group (``None`` before the distributed setup)."""
        return self._group_pgs[self.group_index] if self._group_pgs else None

    @property
    def _guard_process_group(self) -> Any:
        return self.group_process_group  # a guarded step is skipped by the whole group

    # ------------------------------------------------------------------ DDP wrapping
    @property
    def _gradient_group(self) -> Any:
        """The process group DDP averages over: ``None`` (every rank) under ``"global"``, else this rank's group's or
        cluster's."""
        return None if self.gradient_sync == "global" else self._gradient_process_group(strategy_timeout(self))

    @override
    def _setup_model(self, model: Module) -> Module:
        apart = self.gradient_sync != "global"
        if apart and ddp_kwarg(self, "init_sync", True):
            # Groups are separate DDP jobs: start them all from rank 0's weights, then reduce inside the group.
            sync_module_states(model)
        set_ddp_kwarg(self, "process_group", self._gradient_group)
        self._cluster_size = len(self.gradient_ranks)  # (read every step by the guard: computed once per wrap)
        return super()._setup_model(model)

    @override
    def _step_guard_group(self) -> tuple[Any, int]:
        if self.gradient_sync != "cluster":
            return super()._step_guard_group()
        return ddp_kwarg(self, "process_group"), self._cluster_size  # a cluster shares its gradient: skips together

    def _apply_gradient_sync(self) -> None:
        """A model already wrapped is wrapped again by DDP over the new process group."""
        wrapped = self.model
        if isinstance(wrapped, DistributedDataParallel):
            # Why init_sync=False: DDP's constructor would broadcast rank 0's parameters over the new process group,
            # replacing every other group's own (a run resumed after its search holds one model per group).
            user_init_sync = ddp_kwarg(self, "init_sync", True)
            set_ddp_kwarg(self, "init_sync", False)
            self.model = unwrap_ddp(wrapped)
            self.configure_ddp()
            set_ddp_kwarg(self, "init_sync", user_init_sync)
        log.debug("gradient_sync is now %r", self.gradient_sync)

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        guard = self.hdet.guard
        if guard.enabled and not has_user_comm_hook(self) and not self._uses_grad_scaler():
            pg = ddp_kwarg(self, "process_group")
            comm = self.communicator
            guard.hook = FiniteGuard(pg, comm.world_size(pg), self.root_device, comm)
            self.model.register_comm_hook(guard.hook, FiniteGuard.hook)  # type: ignore[union-attr]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's reader, with a clear error for a truncated or corrupted file; adds this group's own state."""
        checkpoint = read_checkpoint(
            lambda: super(HDETStrategy, self).load_checkpoint(checkpoint_path, **weights_only_kwargs(weights_only)),
            checkpoint_path)
        self.attach_own_state(checkpoint, checkpoint_path, weights_only)
        return checkpoint

    @override
    def teardown(self) -> None:
        self.hdet.guard.hook = None  # (the step counter stays: ``skipped_steps`` is read after the fit)
        # DDP's kwargs hold the group's process group under gradient_sync="group": a destroyed gloo group's native
        # threads end only with its last reference (set again at the next entry's set-up).
        set_ddp_kwarg(self, "process_group", None)
        # HDET's groups are destroyed before Lightning's teardown, while the default group they were built on is up.
        # (None in the list: another group's, never created on this rank: gloo on GPUs, above)
        groups, self._group_pgs = self._group_pgs + list(self._cluster_pgs.values()), []
        self._cluster_pgs = {}
        destroy_groups(groups)
        super().teardown()


def _check_ddp_kwargs(cls: type, kwargs: dict[str, Any]) -> None:
    """Reject a misspelled name, and keyword arguments that DistributedDataParallel would only refuse after the
    process groups exist.

    Sharded strategies' options (FSDP's ``sharding_strategy``, DeepSpeed's ``stage``/``offload_optimizer``, ...)
    land here: HDET needs a full model replica on every rank, because groups merge by averaging whole parameters.
    """
    if kwargs.get("process_group") is not None:
        raise ValueError("`process_group` cannot be passed to HDETStrategy: it creates the process groups itself "
                         "(one per HDET group).")
    check_names(cls.__name__, {k: v for k, v in kwargs.items() if k != "process_group"}, own_arguments(cls),
                {"Lightning DDPStrategy": own_arguments(DDPStrategy), "DistributedDataParallel": DDP_OPTIONS},
                "HDETStrategy keeps a full replica on every rank; for sharded (FSDP2) groups use "
                "`strategy=\"hdet_fsdp\"`.")
