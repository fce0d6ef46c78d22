"""Every use of a private Lightning or W&B name, in one place, each with the reason it is needed.

Lightning has no public hook for these. When a Lightning release renames one of them, the checks at the bottom
fail at import with a message naming it, instead of a hook silently no longer being called. Tested versions:
``lightning`` as pinned in ``constraints/base.txt`` (2.6.6) and the floor in ``constraints/lowest.txt`` (2.4.0,
``make test-lowest``); every name below exists in both, and the shims after them cover what changed in between.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer

# Why: the file name Lightning gives the non-tensor part of a distributed checkpoint folder; its own
# `consolidate_checkpoint` reads it back, so "hdet_fsdp" checkpoints must use the same name.
from lightning.fabric.utilities.load import _METADATA_FILENAME as DCP_METADATA_FILENAME

# Why: ModelParallelStrategy materializes meta-device modules (`to_empty` + `reset_parameters`) in its `setup`,
# which "hdet_fsdp" replaces (it shards the model itself when the user did not).
from lightning.fabric.utilities.init import _materialize_distributed_module as materialize_distributed_module

# Why: DDP broadcasts rank 0's weights only when it wraps a model; HDET's "group" mode (one DDP per group) and the
# async strategy (no DDP at all) need the same start-from-rank-0 broadcast without the wrapper.
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.fabric.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

# Why: the registry's type is private; strategies receive it in their public `register_strategies` classmethod.
from lightning.pytorch.strategies.strategy import _StrategyRegistry as StrategyRegistry

# Why: with FSDP2 inside async workers, the fork/spawn launcher's rank 0 must hand the main process the full global
# model (its module holds one shard); the launcher's `_collect_rank_zero_results` is the only place to do it.
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

__all__ = [
    "DDP_OPTIONS",
    "DCP_METADATA_FILENAME",
    "MultiProcessingLauncher",
    "StrategyRegistry",
    "CHECKPOINT_NAMED_BY_RANK_ZERO",
    "attached_trainer",
    "default_store",
    "ddp_kwarg",
    "ensure_callback",
    "show_in_progress_bar",
    "gloo_options",
    "has_user_comm_hook",
    "init_model_parallel",
    "materialize_distributed_module",
    "register_names",
    "set_ddp_kwarg",
    "set_loop_max_steps",
    "strategy_timeout",
    "sync_module_states",
    "unwrap_ddp",
    "unwrap_optimizer",
    "wandb_run_created_in_this_process",
    "weights_only_kwargs",
]

#: Private DDPStrategy methods the strategies override (no public hook runs at those moments):
#: ``_configure_launcher`` runs when the Trainer is built, before any process exists, which is where argument
#: checks that need the world size belong; ``_setup_model`` is where DDP gets its process group.
OVERRIDDEN_PRIVATE_HOOKS = ("_configure_launcher", "_setup_model")


#: Lightning 2.6 added ``weights_only`` to ``Strategy.load_checkpoint`` and ``CheckpointIO.load_checkpoint``; 2.4 and
#: 2.5 take the path alone (and load as ``torch.load``'s default says).
CHECKPOINT_TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(TorchCheckpointIO.load_checkpoint).parameters


#: Lightning 2.6's ModelCheckpoint lets rank 0 alone decide whether a checkpoint name is taken. Before (2.4, 2.5) every
#: rank looks itself, so an async worker that saves after rank 0 wrote the file names its own file "...-v1": on
#: resume it finds none and starts from rank 0's inner state (with a warning). The async strategy warns up front.
CHECKPOINT_NAMED_BY_RANK_ZERO = "reduce_boolean_decision" in inspect.getsource(ModelCheckpoint.file_exists)


def weights_only_kwargs(weights_only: Optional[bool]) -> dict[str, Any]:
    """``{"weights_only": ...}`` for the Lightning releases whose checkpoint readers take it, else ``{}``."""
    return {"weights_only": weights_only} if CHECKPOINT_TAKES_WEIGHTS_ONLY else {}


def default_store() -> Any:
    """The default process group's key-value store.

    Why: the async strategy hands rank 0's checkpoint requests to workers that train apart (no collective can
    meet) through the store every rank already reaches; torch has no public accessor for it.
    """
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def sync_module_states(module: Module) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (what DDP does when it wraps a model)."""
    _sync_module_states(module)


def attached_trainer(model: LightningModule) -> Optional[Trainer]:
    """The Trainer a module is attached to, or ``None`` (``model.trainer`` raises when there is none)."""
    return model._trainer  # why: the public property raises instead of returning None before `fit`


def validation_loaders(trainer: Trainer) -> list[Any]:
    """The fit's validation dataloaders, set up as the fit loop sets them up (it skips that when the first epoch
    does not validate); run with the trainer validating, so the sampler and the transfer hooks see validation."""
    loaders = trainer.val_dataloaders
    if loaders is None:
        trainer.fit_loop.epoch_loop.val_loop.setup_data()  # why: no public way to ask for them before validation
        loaders = trainer.val_dataloaders
    if isinstance(loaders, Mapping):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [] if loaders is None else [loaders]


def requested_devices(trainer: Trainer) -> int:
    """How many devices the user gave the Trainer (``devices=``), also under a one-device strategy, which keeps
    only the first."""
    return len(trainer._accelerator_connector._parallel_devices or [])  # why: no public accessor


def ensure_callback(model: LightningModule, callback_type: type[Callback], make: Any = None,
                    first: bool = False) -> None:
    """Append ``make()`` (default: ``callback_type()``) to the Trainer's callbacks unless one is there; ``first``:
    put it (or the one there) before the others, so that its hooks run first.

    Why here: a strategy's ``connect`` is the first moment it sees the Trainer; companion callbacks (HDET's vote,
    async's logging) are installed there when the user passed none.
    """
    trainer = attached_trainer(model)
    if trainer is None:
        return
    found = [cb for cb in trainer.callbacks if isinstance(cb, callback_type)]
    callback = found[0] if found else (make or callback_type)()
    if found and not first:
        return
    if found:
        trainer.callbacks.remove(callback)
    trainer.callbacks.insert(0 if first else len(trainer.callbacks), callback)


def show_in_progress_bar(trainer: Trainer, metrics: dict[str, Any]) -> None:
    """Show ``metrics`` in the progress bar as they are (an ``int`` stays an integer).

    Why: ``LightningModule.log`` turns every value into a float tensor (a worker's index showed as ``1.000``);
    ``trainer.progress_bar_metrics`` is the dict the progress bar reads and keeps what is added to it until the next
    entry resets it.
    """
    trainer.progress_bar_metrics.update(metrics)


#: The keyword arguments of torch's DistributedDataParallel a strategy's ``**kwargs`` may really set: Lightning passes
#: ``module`` and ``device_ids`` itself, and our strategies set ``process_group``.
DDP_OPTIONS = tuple(sorted(set(inspect.signature(DistributedDataParallel.__init__).parameters)
                           - {"self", "module", "device_ids", "process_group"}))


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind a ``LightningOptimizer`` (identity comparisons need the real object)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def strategy_timeout(strategy: DDPStrategy, default: timedelta = timedelta(minutes=30)) -> timedelta:
    """The ``timeout=`` the user gave the strategy (our own process groups must honour it too)."""
    return strategy._timeout or default  # why: DDPStrategy keeps it private and has no getter


def ddp_kwarg(strategy: DDPStrategy, name: str, default: Any = None) -> Any:
    """One of the keyword arguments the strategy wraps the model with (``process_group``: ``None`` is all ranks)."""
    return strategy._ddp_kwargs.get(name, default)  # why: no public accessor for the DDP kwargs


def set_ddp_kwarg(strategy: DDPStrategy, name: str, value: Any) -> None:
    """Wrap the model with ``name=value`` (HDET's "group" mode sets ``process_group``); call before ``_setup_model``."""
    strategy._ddp_kwargs = {**strategy._ddp_kwargs, name: value}


def unwrap_ddp(wrapped: Any) -> Module:
    """The module inside ``wrapped``, its DDP gradient hooks removed (to wrap it again over another process group).

    Why: the wrapper's autograd hooks stay on the parameters until it is garbage-collected; left there, every backward
    would also reduce over the old process group. torch has no public API to remove them (2.13).
    """
    wrapped._remove_autograd_hooks()
    return wrapped.module  # type: ignore[return-value]


def has_user_comm_hook(strategy: DDPStrategy) -> bool:
    """Whether the user registered a DDP communication hook (then HDET's finite-gradient hook stays out)."""
    return strategy._ddp_comm_hook is not None or strategy._ddp_comm_wrapper is not None


def init_model_parallel(strategy: ModelParallelStrategy, mesh: Any) -> None:
    """Start the default process group as ModelParallelStrategy does and publish ``mesh`` as its device mesh.

    Why: "hdet_fsdp" needs a (group, shard) mesh where ModelParallelStrategy's `setup_environment` builds a
    (data_parallel, tensor_parallel) one; its process-group set-up and the mesh attributes
    (`strategy.device_mesh`, `LightningModule.device_mesh`) have no public setter.
    """
    strategy._setup_distributed()
    strategy._device_mesh = mesh(strategy)
    strategy.lightning_module._device_mesh = strategy._device_mesh


def set_loop_max_steps(trainer: Trainer, max_steps: int) -> None:
    """Change the step limit of a running fit (the async budget is enforced by the strategy, not the loop)."""
    trainer.fit_loop.epoch_loop.max_steps = max_steps  # why: `Trainer.max_steps` is read-only


def register_names(registry: StrategyRegistry, cls: type, entries: Iterable[tuple[str, str, dict[str, Any]]]) -> None:
    """Register ``(name, description, init_params)`` entries without replacing names a user registered."""
    for name, description, params in entries:
        if name not in registry:
            registry.register(name, cls, description=description, **params)


def wandb_run_created_in_this_process(logger: Any) -> Optional[Any]:
    """A W&B logger's run if it exists, was started by this process and is not attached from another one."""
    import os

    from lightning.pytorch.loggers import WandbLogger

    if not isinstance(logger, WandbLogger):
        return None
    run = getattr(logger, "_experiment", None)  # why: `.experiment` would *create* a run; we only look
    created_here = getattr(run, "_init_pid", None) == os.getpid()  # why: W&B has no public "owner pid"
    if run is None or not created_here or getattr(run, "_is_attached", True):
        return None
    return run


def gloo_options(timeout: timedelta, host: str) -> Any:
    """Options of a ``ProcessGroupGloo`` whose device is bound to ``host`` (elastic sessions bind to the address the
    user gives)."""
    import torch.distributed as dist

    # why: torch's public constructor takes only a timeout and picks the device from the host name; the options'
    # fields are underscored (torch's own `new_group` sets them the same way)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return options


def _check_private_names() -> None:
    missing = [f"DDPStrategy.{name}" for name in OVERRIDDEN_PRIVATE_HOOKS + ("_timeout", "_ddp_kwargs")
               if not hasattr(DDPStrategy, name) and name not in DDPStrategy.__init__.__code__.co_names]
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy

    # the Fabric strategies read and set the same two through the functions above
    missing += [f"lightning.fabric DDPStrategy.{name}" for name in ("_timeout", "_ddp_kwargs")
                if name not in FabricDDPStrategy.__init__.__code__.co_names]
    in_init = ModelParallelStrategy.__init__.__code__.co_names
    missing += [f"ModelParallelStrategy.{name}" for name in ("_setup_distributed", "_device_mesh", "_timeout")
                if not hasattr(ModelParallelStrategy, name) and name not in in_init]

    if not hasattr(MultiProcessingLauncher, "_collect_rank_zero_results"):
        missing.append("_MultiProcessingLauncher._collect_rank_zero_results")
    if not hasattr(DistributedDataParallel, "_remove_autograd_hooks"):
        missing.append("torch.nn.parallel.DistributedDataParallel._remove_autograd_hooks")
    if missing:
        import lightning
        import torch

        raise ImportError(
            f"lightning_hdet relies on {missing}, which lightning {lightning.__version__} / torch {torch.__version__} "
            "do not have; install the versions from lightning_hdet's constraints (see pyproject.toml)."
        )


_check_private_names()
