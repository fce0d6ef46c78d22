"""``Fabric(strategy="hdet")``: HDET's groups, multipliers and merges on Lightning Fabric's DDP strategy.

The same core as the Trainer's ``"hdet"`` (:class:`~lightning_hdet.hdet.lightning.strategy.HDETStrategy`): the groups,
the multiplier table and the vote's collective come from :class:`~lightning_hdet.hdet.lightning.groups.HDETGroups`,
merges, the restore point and the merged state dict from :class:`~lightning_hdet.hdet.lightning.ensemble.EnsembleOps`.
What differs is Fabric's shape of a strategy: the user's loop calls ``optimizer.step()`` (Fabric routes it to
:meth:`HDETFabricStrategy.optimizer_step`, where this rank's multipliers are applied), Fabric has no callbacks, so
the loop drives the votes through :class:`~lightning_hdet.fabric.loop.HDETLoop`, and ``fabric.save`` asks the
strategy for each module's state (:meth:`get_module_state_dict`: the merged model).

Its defaults are the Trainer's (:data:`~lightning_hdet.hdet.rules.defaults.DEFAULT_PRESET`): the same grid, and under
``gradient_sync="group"`` a search whose end switches every group to gradients averaged over all ranks. The Trainer
wraps its model in DDP again for that; a Fabric loop holds the DDP wrapper ``fabric.setup`` returned, so here DDP
averages a group's gradients through a communication hook (:class:`GradientMean`) whose process group the switch
replaces between two steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_names, own_arguments
from lightning_hdet._compat import DDP_OPTIONS, register_names, set_ddp_kwarg, strategy_timeout, sync_module_states
from lightning_hdet._process_groups import destroy_default_group_at_exit, destroy_groups
from lightning_hdet.hdet.execution.comm import Communicator
from lightning_hdet.hdet.hyperparams import Span, check_optimizers
from lightning_hdet.hdet.lightning.ensemble import EnsembleOps, ReplicaSite
from lightning_hdet.hdet.lightning.groups import GradientSync, HDETGroups
from lightning_hdet.hdet.multipliers import check_numeric_lrs
from lightning_hdet.hdet.rules.defaults import DEFAULT_PRESET


class HDETFabricStrategy(HDETGroups, EnsembleOps, FabricDDPStrategy):
    """Data parallelism with groups of replicas that train with different learning rates, for Fabric loops.

    Args:
        num_groups: number of groups (``None``: from the world size and the preset), as for the Trainer's
            :class:`~lightning_hdet.hdet.lightning.strategy.HDETStrategy`.
        lr_multipliers: one learning-rate multiplier per group (``None``: the preset's grid, or the fan-out set by
            ``spread``), as for the Trainer's strategy.
        spread: half-width of the published fan-out, in ``[0, 1)`` (``None``: the preset's).
        gradient_sync: ``"global"`` (gradients averaged over all ranks), ``"group"`` (inside each group, until
            the search ends) or ``"cluster"`` (experimental: inside each cluster of groups, as for the Trainer's
            HDETStrategy); ``None``: the preset's.
        preset: ``"recommended"`` (default, as the Trainer's ``"hdet"``: a geometric grid around the optimizer's
            LR, ``"group"``, and for :class:`~lightning_hdet.fabric.loop.HDETLoop` a PBT search ending a quarter
            into ``max_steps``) or ``"published"`` (the paper's ±11 % fan-out, ``"global"``, the softmax vote and
            no end to the search).
        explore: other hyperparameters the groups diverge in, as for the Trainer's HDETStrategy.
        communicator: what every HDET collective goes through (``None``: ``torch.distributed``), as for the
            Trainer's HDETStrategy.
        **kwargs: everything Fabric's :class:`~lightning.fabric.strategies.DDPStrategy` accepts.

    Set the model and optimizer up with ``fabric.setup(model, optimizer)`` (one model; its optimizers get the
    multipliers); vote with :class:`~lightning_hdet.fabric.loop.HDETLoop`. ``fabric.save`` writes the merged
    model (a collective: call it on every rank, as Fabric requires anyway) and rank 0's optimizer state;
    ``fabric.load`` gives every group that merged model, which also becomes the restore point.

    The Trainer strategy's non-finite step guard (a DDP communication hook that skips a group's non-finite steps)
    is not installed here: a group whose loss diverges is still caught at the next vote and rescued from the
    others, or every group rolls back to the last good merge.
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
        if kwargs.get("process_group") is not None:
            raise ValueError("`process_group` cannot be passed to HDETFabricStrategy: it creates the process groups "
                             "itself (one per HDET group).")
        kwargs.pop("process_group", None)
        check_names(type(self).__name__, kwargs, own_arguments(type(self)),
                    {"Fabric DDPStrategy": own_arguments(FabricDDPStrategy), "DistributedDataParallel": DDP_OPTIONS})
        self._init_groups(num_groups, lr_multipliers, spread, gradient_sync, preset, explore)
        super().__init__(**kwargs)
        self._group_pgs: list[Any] = []
        self._init_parts(ReplicaSite(self), communicator)
        self._module: Optional[Module] = None
        self._optimizers: list[Optimizer] = []
        self._gradient_mean: Optional[GradientMean] = None  # the switchable hook, under gradient_sync="group"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"hdet"`` (subprocess launcher), ``"hdet_spawn"`` and ``"hdet_fork"`` (notebooks) in Fabric's
        registry, without replacing names a user registered."""
        register_names(strategy_registry, cls, [
            (name, f"HDET for Fabric with `start_method` '{method}'", {"start_method": method})
            for name, method in (("hdet", "popen"), ("hdet_spawn", "spawn"), ("hdet_fork", "fork"))
        ])

    # ------------------------------------------------------------------ what the shared core reads
    @property
    def lightning_module(self) -> Module:
        """The model set up by ``fabric.setup`` (unwrapped): the name the shared core reads it by."""
        if self._module is None:
            raise RuntimeError("HDETFabricStrategy has no model yet: call `fabric.setup(model, optimizer)` first.")
        return self._module

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers set up by ``fabric.setup``/``fabric.setup_optimizers``, in that order (their param groups
        are the multiplier table's columns)."""
        return self._optimizers

    # ------------------------------------------------------------------ process groups and set-up
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._group_pgs = self._new_group_process_groups(strategy_timeout(self))
        destroy_default_group_at_exit()

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._module is not None and self._module is not module:
            raise ValueError("HDETFabricStrategy trains one model: `fabric.setup` was called for a second one.")
        self._module = module
        apart = self.gradient_sync != "global"
        if apart:
            # Groups are separate DDP jobs: start them all from rank 0's weights, then reduce inside the group.
            sync_module_states(module)
            set_ddp_kwarg(self, "process_group", self._group_pgs[self.group_index])
        wrapped = super().setup_module(module)
        if apart and self.num_groups > 1:  # votes and the search's end switch its ranks (`_apply_gradient_sync`)
            ranks = self._gradient_process_group(strategy_timeout(self)), len(self.gradient_ranks)
            self._gradient_mean = GradientMean(*ranks, self.communicator)
            wrapped.register_comm_hook(self._gradient_mean, GradientMean.hook)
        return wrapped

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_numeric_lrs([optimizer])
        check_optimizers([optimizer], list(self._explore))
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    def _apply_gradient_sync(self) -> None:
        """``"group"``/``"cluster"`` -> ``"global"``, or new clusters: the DDP hook averages over the new ranks from
        the next backward on (the user's loop keeps the DDP wrapper Fabric returned)."""
        mean = self._gradient_mean
        if self.num_groups == 1:
            return  # the one group is every rank already
        if mean is None or self.gradient_sync == "group":
            raise ValueError(
                "HDETFabricStrategy switches `gradient_sync` only from 'group' or 'cluster' (set up with `fabric.setup` "
                f"and more than one group) to 'global', or between clusters; it cannot become {self.gradient_sync!r} "
                "here."
            )
        if self.gradient_sync == "global":
            mean.process_group, mean.size = None, self.world_size
        else:
            mean.process_group = self._gradient_process_group(strategy_timeout(self))
            mean.size = len(self.gradient_ranks)

    # ------------------------------------------------------------------ the step
    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The user's ``optimizer.step()``: this group's learning rates for the duration of the step."""
        with self.scaled_lr(optimizer):
            return FabricDDPStrategy.optimizer_step(self, optimizer, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The merged model for HDET's model (a collective), what any other module says for the others."""
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        if inner is self._module:
            return self.lightning_module_state_dict()
        return super().get_module_state_dict(module)

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Every group takes the loaded model, which becomes the restore point."""
        super().load_module_state_dict(module, state_dict, strict=strict)
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        if inner is self._module:
            self.hdet.merger.load_restore_point(None)
            self.hdet.merger.ensure_restore_point()

    @override
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        # Fabric's signature, not the Trainer's that EnsembleOps extends (its per-group files are Trainer-only).
        FabricDDPStrategy.save_checkpoint(self, *args, **kwargs)

    @override
    def teardown(self) -> None:
        set_ddp_kwarg(self, "process_group", None)  # the last reference to a group ends its native threads
        self._gradient_mean = None
        groups, self._group_pgs = self._group_pgs + list(self._cluster_pgs.values()), []
        self._cluster_pgs = {}
        destroy_groups(groups)
        super().teardown()


class GradientMean:
    """DDP communication hook state: a bucket of gradients averaged over ``process_group`` (``None``: every rank),
    replaced between steps by :meth:`HDETFabricStrategy._apply_gradient_sync`; the sum goes through ``comm``."""

    def __init__(self, process_group: Any, size: int, comm: Communicator) -> None:
        self.process_group = process_group
        self.size = size
        self.comm = comm

    @staticmethod
    def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP rejects string annotations at registration)
        buffer = bucket.buffer().div_(state.size)
        return state.comm.all_reduce_future(buffer, state.process_group)
