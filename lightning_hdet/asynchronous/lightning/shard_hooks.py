"""The strategy's argument checks, and its side of FSDP2 inside workers (the exchange's: :mod:`.worker_shards`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_hdet._checks import check_names, is_int, own_arguments
from lightning_hdet._compat import DDP_OPTIONS, attached_trainer
from lightning_hdet._launch import HandingBackLauncher
from lightning_hdet._sharding import is_sharded
from lightning_hdet.asynchronous.exchange.worker_shards import local_state, state_from_flat
from lightning_hdet.asynchronous.outer.state import OuterState

#: DDPStrategy's own arguments; any other keyword (and its DDP-hook ones) is for DDP inside a worker.
_STRATEGY_ARGS = set(inspect.signature(DDPStrategy.__init__).parameters) - {
    "self", "kwargs", "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"}


def ddp_arguments(kwargs: Mapping[str, Any]) -> list[str]:
    """The keyword arguments that only DDP inside a worker reads."""
    return [k for k in kwargs if k not in _STRATEGY_ARGS]


def check_names_of(cls: type, kwargs: Mapping[str, Any], ranks_per_worker: Any) -> None:
    """Refuse a name not the strategy's, DDPStrategy's or (several ranks per worker) DDP's."""
    several = is_int(ranks_per_worker) and ranks_per_worker > 1
    hint = "" if several or not set(kwargs) & set(DDP_OPTIONS) else (
        "With `ranks_per_worker=1` no DistributedDataParallel wraps the model, so its options do nothing; they apply"
        " inside workers of several ranks (`ranks_per_worker` > 1).")
    check_names(cls.__name__, kwargs, own_arguments(cls),
                {"Lightning DDPStrategy": own_arguments(DDPStrategy), **({"DistributedDataParallel": DDP_OPTIONS}
                                                                         if several else {})}, hint)


def check_ddp_hooks(kwargs: Mapping[str, Any], ranks_per_worker: int) -> None:
    """Refuse DDP's hook arguments where they would do nothing."""
    if "model_averaging_period" in kwargs or ("ddp_comm_hook" in kwargs and ranks_per_worker == 1):
        raise ValueError("`ddp_comm_hook` / `model_averaging_period` do not apply: with `ranks_per_worker=1` the"
                         " model is not wrapped in DDP (a `ddp_comm_hook` applies inside workers of several ranks).")


def check_sharded_entry(model: pl.LightningModule) -> None:
    """Refuse an entry on a module a previous ``fit`` left sharded over groups that ended with it."""
    trainer = attached_trainer(model)
    if trainer is not None and is_sharded(model):
        raise ValueError(
            f"`inside_worker='fsdp'`: this {type(model).__name__} is still sharded by a previous fit, over process"
            " groups that ended with it. Load the checkpoint's state_dict (the full global model) into a new module"
            " for validate/test/predict or another fit.")


def sharded_module_state(module: pl.LightningModule, snapshot: Mapping[str, Any] | None, outer: OuterState | None,
                         writes: bool) -> dict[str, Any]:
    """The state dict a checkpoint holds, never gathered: rank 0's global model of ``snapshot`` or ``outer``;
    elsewhere this rank's shards (nobody reads them). ``writes``: this rank writes the checkpoint."""
    if snapshot is not None:
        return state_from_flat(module, snapshot["params"], snapshot["buffers"])
    if outer is not None:
        with outer.model_lock:
            return state_from_flat(module, outer.params, outer.buffers)
    if writes:
        raise RuntimeError("`inside_worker='fsdp'`: rank 0 has no global model to write before its first fit starts"
                           " training (its module holds one shard).")
    return local_state(module.state_dict())


class ShardedWorkersLauncher(HandingBackLauncher):
    """Lightning's fork/spawn launcher, handing the main process the outer state's global model (and the result)."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        module, outer = trainer.lightning_module, getattr(trainer.strategy, "_outer", None)
        if outer is None:
            return super()._collect_rank_zero_results(trainer, results)
        full = sharded_module_state(module, None, outer, True)
        module.state_dict = lambda *args, **kwargs: full  # why: the launcher reads module.state_dict() itself
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
