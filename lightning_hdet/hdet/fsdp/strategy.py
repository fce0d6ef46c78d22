"""HDETFSDPStrategy (``"hdet_fsdp"``): HDET groups that are FSDP2 shard groups, for models that don't fit one device.

The ranks form a ``(group, shard)`` device mesh. Each HDET group shards every parameter, gradient and optimizer
state over its ``group_size`` ranks with FSDP2's ``fully_shard``; the ranks holding the same shard in different
groups exchange only that shard: the gradient mean of ``gradient_sync="global"`` (HSDP), merges, and the merged
model of a checkpoint. Everything HDET-specific (groups, learning-rate multipliers, the vote's collective) is
shared with ``"hdet"`` through :class:`~lightning_hdet.hdet.lightning.groups.HDETGroups`; the same
:class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` drives votes, blends and the safety net.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_names, own_arguments, require
from lightning_hdet._compat import (
    StrategyRegistry,
    init_model_parallel,
    materialize_distributed_module,
    register_names,
)
from lightning_hdet._process_groups import destroy_default_group_at_exit
from lightning_hdet._sharding import ShardingPolicy, is_sharded, shard
from lightning_hdet._text import counted
from lightning_hdet.hdet.execution.comm import Communicator
from lightning_hdet.hdet.fsdp import checkpoint as fsdp_checkpoint
from lightning_hdet.hdet.fsdp.ensemble import ShardedEnsembleOps, ShardSite
from lightning_hdet.hdet.fsdp.shards import (
    GroupGradientMean,
    broadcast_from_first_group,
    check_mesh,
    set_all_reduce_hook,
)
from lightning_hdet.hdet.hyperparams import Span
from lightning_hdet.hdet.lightning.groups import GradientSync, HDETGroups
from lightning_hdet.hdet.lightning.metric_sync import GroupMetricSync
from lightning_hdet.hdet.rules.defaults import DEFAULT_PRESET

# fully_shard's keyword arguments a user may pass through; HDET owns the mesh.
_FSDP_KWARGS = tuple(sorted(set(inspect.signature(fully_shard).parameters) - {"module", "mesh"}))


class HDETFSDPStrategy(GroupMetricSync, HDETGroups, ShardedEnsembleOps, ModelParallelStrategy):
    """HDET with every group an FSDP2 shard group: each rank holds ``1 / group_size`` of the model and optimizer.

    Args:
        num_groups: number of groups. ``None``: chosen from the world size as for ``HDETStrategy`` (one group per
            rank, unsharded, up to 4 ranks; then four groups, each sharded over a quarter of the ranks). Must divide
            the world size.
        lr_multipliers: one learning-rate multiplier per group; ``None``: the preset's, or the fan-out set by
            ``spread``.
        spread: half-width of the symmetric fan-out of multipliers, in ``[0, 1)``; ``None``: the preset's.
        gradient_sync: ``"group"``: each group is its own FSDP job; groups diverge between merges (recommended).
            ``"global"``: each gradient shard is averaged over all groups every step (HSDP; groups differ only in
            step size). ``None``: the preset's.
        preset: ``"recommended"`` or ``"published"``, as for :class:`~lightning_hdet.HDETStrategy`.
        explore: other hyperparameters the groups diverge in, as for :class:`~lightning_hdet.HDETStrategy`.
        auto_wrap_policy: which submodules become FSDP units (their own all-gather/free), as for Lightning's
            ``FSDPStrategy``: a set of module classes (e.g. ``{TransformerBlock}``) or a predicate on a module.
            ``None``: the whole model is one unit. Ignored when ``configure_model`` already called ``fully_shard``
            (shard on ``self.device_mesh["shard"]``).
        process_group_backend, timeout: as for ``ModelParallelStrategy``.
        communicator: what every HDET collective goes through
            (:class:`~lightning_hdet.hdet.execution.comm.Communicator`); ``None``: ``torch.distributed`` over the
            strategy's device mesh.
        **fsdp_kwargs: passed to every ``fully_shard`` call the strategy makes (``mp_policy``,
            ``reshard_after_forward``, ``offload_policy``, ...).
    """

    strategy_name = "hdet_fsdp"

    def __init__(
        self,
        num_groups: Optional[int] = None,
        lr_multipliers: Optional[Sequence[float]] = None,
        spread: Optional[float] = None,
        gradient_sync: Optional[GradientSync] = None,
        preset: str = DEFAULT_PRESET,
        explore: Optional[Mapping[str, Span]] = None,
        auto_wrap_policy: ShardingPolicy = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        communicator: Optional[Communicator] = None,
        **fsdp_kwargs: Any,
    ) -> None:
        check_names(type(self).__name__, fsdp_kwargs, own_arguments(type(self)), {"fully_shard": _FSDP_KWARGS},
                    "HDETFSDPStrategy builds the device mesh itself." if "mesh" in fsdp_kwargs else "")
        self._init_groups(num_groups, lr_multipliers, spread, gradient_sync, preset, explore)
        require("gradient_sync", gradient_sync, gradient_sync != "cluster", "'group' or 'global' with hdet_fsdp",
                "Clusters of groups need process groups of unequal size, which the FSDP2 device mesh of equal groups "
                "does not have; use strategy='hdet' (DDP) for gradient_sync='cluster'.")
        policy_ok = auto_wrap_policy is None or callable(auto_wrap_policy) or (
            isinstance(auto_wrap_policy, (set, frozenset, list, tuple))
            and all(isinstance(c, type) and issubclass(c, Module) for c in auto_wrap_policy))
        require("auto_wrap_policy", auto_wrap_policy, policy_ok,
                "None, a set of torch.nn.Module classes or a callable(module) -> bool")
        super().__init__(save_distributed_checkpoint=True, process_group_backend=process_group_backend,
                         **({"timeout": timeout} if timeout is not None else {}))
        self.auto_wrap_policy = auto_wrap_policy
        self.fsdp_kwargs = fsdp_kwargs
        self._init_parts(ShardSite(self), communicator)
        self._mesh_world: Any = None  # the default group the device mesh was built on

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"hdet_fsdp"`` without replacing an existing entry."""
        register_names(strategy_registry, cls, [("hdet_fsdp", "HDET groups as FSDP2 shard groups", {})])

    # ------------------------------------------------------------------ mesh and process groups
    @override
    def _configure_launcher(self) -> None:
        world_size = self.num_nodes * self.num_processes
        require("devices", world_size, world_size > 1, "more than one process in all",
                "HDETFSDPStrategy shards each group over its ranks; with one process use a plain strategy.")
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy's own builds a (data_parallel, tensor_parallel) mesh; HDET's is (group, shard).
        init_model_parallel(self, type(self)._mesh)
        destroy_default_group_at_exit()
        rank_zero_info(f"HDET-FSDP: {counted(self.num_groups, 'group')} sharded over "
                       f"{counted(self.layout.group_size, 'rank')} each")

    def _mesh(self) -> DeviceMesh:
        """The (group, shard) mesh, built by the first trainer entry and reused by the later ones: a model sharded
        in one entry stays sharded on that mesh's process groups, so they must outlive the entry (a new mesh per entry
        would leave every earlier one's groups alive). A new default group (the old one destroyed) needs a new mesh."""
        if self._device_mesh is None or self._mesh_world is not dist.group.WORLD:
            self._device_mesh = init_device_mesh(self.root_device.type, (self.num_groups, self.layout.group_size),
                                                 mesh_dim_names=("group", "shard"))
            self._mesh_world = dist.group.WORLD
        return self._device_mesh

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's group: FSDP2 shards every parameter over it."""
        return self.device_mesh["shard"]

    @property
    def across_groups(self) -> Any:
        """The process group of the ranks that hold the same shard in every group (merges, shared gradients)."""
        return self.device_mesh.get_group("group")

    @property
    def _guard_process_group(self) -> Any:
        return self.shard_mesh.get_group()  # a guarded step is skipped by the whole group

    # ------------------------------------------------------------------ sharding
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not is_sharded(self.model):
            shard(self.model, self.shard_mesh, self.auto_wrap_policy, **self.fsdp_kwargs)
        check_mesh(self.model, self.shard_mesh)
        materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Groups start from group 0's shards: with meta-device or unseeded init every rank's own would differ.
        broadcast_from_first_group(self.model, self.across_groups, self.communicator)
        self._install_gradient_mean()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _install_gradient_mean(self) -> None:
        """``"global"``: each group's reduced gradient shard is averaged over the groups (guarded when the guard is
        on); ``"group"``: no hook."""
        shared = self.gradient_sync == "global" and self.num_groups > 1
        guard = self.hdet.guard
        mean = GroupGradientMean(self.across_groups, self.num_groups, self.root_device, guard.enabled,
                                 self.communicator) if shared else None
        set_all_reduce_hook(self.model, mean)
        guard.hook = mean if guard.enabled else None

    def _apply_gradient_sync(self) -> None:
        """The all-reduce hook that averages gradient shards over the groups is installed or removed (no collective)."""
        if self.model is not None and is_sharded(self.model):
            self._install_gradient_mean()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model (mean of the groups), as sharded DTensors and buffers: a collective on every rank."""
        return fsdp_checkpoint.merged_state(self.model, self.num_groups, self.across_groups,
                                            self.shard_mesh.get_group(), self.layout.group_size, self.communicator)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This group's own sharded optimizer state (saved under the group's key)."""
        return fsdp_checkpoint.own_optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A torch.distributed.checkpoint folder: ``model`` (merged) and ``hdet_group<g>`` (each group's own state)."""
        require("storage_options", storage_options, storage_options is None, "None",
                "HDETFSDPStrategy writes a torch.distributed.checkpoint folder, not through a CheckpointIO.")
        path = Path(self.broadcast(filepath))
        fsdp_checkpoint.save(checkpoint, path, self.model, self.group_index, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Each group resumes its own state; with another number of groups, every group starts from the merged model
        and a fresh optimizer state."""
        path = Path(self.broadcast(checkpoint_path))
        return fsdp_checkpoint.load(path, self.model, self.optimizers, self.group_index, self.num_groups,
                                    self.global_rank, weights_only=weights_only)

    @override
    def teardown(self) -> None:
        self.hdet.guard.hook = None
        super().teardown()
