"""The strategy's DDP base while the workers train apart: collectives answered locally (the workers are at different
step counts, so Lightning's per-step collectives could not meet), and workers of several ranks (the exchange's side
is :mod:`~..exchange.ranks`): each worker's two process groups, DDP (or FSDP2) over its ranks, and its ranks stopping
together at the end of a round."""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_hdet._compat import ensure_callback, set_ddp_kwarg, strategy_timeout
from lightning_hdet._process_groups import destroy_groups
from lightning_hdet.asynchronous.exchange.exchange import Exchange
from lightning_hdet.asynchronous.exchange.ranks import WorkerRanks, check_ranks_per_worker
from lightning_hdet.asynchronous.exchange.worker_shards import shard_worker
from lightning_hdet.asynchronous.lightning.local_metrics import make_metrics_local, restore

log = logging.getLogger(__name__)


class LocalCollectivesStrategy(DDPStrategy):
    """DDPStrategy with local collectives while :attr:`training_apart` (:meth:`train_apart`); rank 0 decides."""

    training_apart = False
    _metric_syncs: dict[Any, Any] = {}

    def train_apart(self, apart: bool) -> None:
        """The workers start (or stop) training apart: collectives, torchmetrics' own syncs included, stay local."""
        self.training_apart = apart
        if apart:
            self._metric_syncs = make_metrics_local(self.lightning_module)
        else:
            restore(self._metric_syncs)
            self._metric_syncs = {}

    @property
    @override
    def world_size(self) -> int:
        """1 while workers train apart, so Lightning's loops issue no collectives."""
        return 1 if self.training_apart else super().world_size

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.training_apart:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self.training_apart else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor if self.training_apart else super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor if self.training_apart else super().all_gather(tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """While training apart only rank 0 decides; its stop reaches the workers through the exchange."""
        if self.training_apart:
            return bool(decision) and self.is_global_zero
        return super().reduce_boolean_decision(decision, all)


class RankGroups(LocalCollectivesStrategy):
    """Workers of ``ranks_per_worker`` ranks: DDP (or FSDP2) over each, a ``gloo`` group to hand replies on."""

    ranks_per_worker = 1
    inside_worker = "ddp"
    auto_wrap_policy: Any = None
    _exchange: Exchange | None = None
    # this rank's worker's groups: DDP's (the default backend) and the exchange's (gloo)
    _worker_groups: tuple[Any, Any] | None = None

    def check_worker_layout(self) -> None:
        """Before any process group: ``ranks_per_worker`` splits the world; a worker across two nodes warns."""
        k, per_node = self.ranks_per_worker, self.num_processes
        check_ranks_per_worker(k, self.num_nodes * per_node)
        if self.num_nodes > 1 and per_node % k and k % per_node:
            rank_zero_warn(f"ranks_per_worker={k} with devices={per_node} per node: some workers span two nodes, and"
                           " their gradient all-reduce crosses the network every step. Use a divisor or a multiple of"
                           f" {per_node} (ranks_per_worker={per_node}: one worker per node).")

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """With several ranks per worker, attach :class:`StopAtRoundEnd` too."""
        super().connect(model)
        if self.ranks_per_worker > 1:
            ensure_callback(model, StopAtRoundEnd)

    @property
    def worker_ranks(self) -> WorkerRanks:
        return WorkerRanks(self.num_nodes * self.num_processes, self.ranks_per_worker, self.global_rank)

    def wrap_worker_ddp(self) -> None:
        """Several ranks per worker: every worker's groups (each rank makes all), then DDP or FSDP2."""
        ranks = self.worker_ranks
        if ranks.ranks_per_worker == 1:
            return
        timeout = strategy_timeout(self)
        for worker in range(ranks.workers):
            members = ranks.ranks_of(worker)
            groups = (dist.new_group(members, timeout=timeout),
                      dist.new_group(members, timeout=timeout, backend="gloo"))
            if worker == ranks.worker:
                self._worker_groups = groups
        assert self._worker_groups is not None
        if self.inside_worker == "fsdp":
            shard_worker(self.model, self._worker_groups[0], self.root_device.type, self.auto_wrap_policy)
            return
        set_ddp_kwarg(self, "process_group", self._worker_groups[0])
        DDPStrategy.configure_ddp(self)

    def release_worker_groups(self) -> None:
        """Unwrap the model and destroy this rank's worker groups (teardown, on every path)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        groups, self._worker_groups = self._worker_groups, None
        if groups is not None:  # no reference may keep a destroyed group's threads alive
            set_ddp_kwarg(self, "process_group", None)
        destroy_groups(groups or ())

    @property
    def shard_group(self) -> Any:
        """The group this rank's worker shards over (``None`` unless FSDP2 inside)."""
        return self._worker_groups[0] if self.inside_worker == "fsdp" and self._worker_groups is not None else None

    @property
    def exchange_group(self) -> Any:
        """The ``gloo`` group this rank's worker hands replies on over (``None``: one rank per worker)."""
        return self._worker_groups[1] if self._worker_groups is not None else None

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Rank 0 validates alone, never through DDP, whose forward may sync buffers with the training ranks."""
        if not isinstance(self.model, DistributedDataParallel):
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def stop_at_round_end(self, trainer: pl.Trainer) -> None:
        """Rank 0 decided to stop: its worker's ranks stop together at the round's end (via the server)."""
        exchange = self._exchange
        if (self.ranks_per_worker == 1 or not self.training_apart or not trainer.should_stop or exchange is None
                or exchange.outer is None or exchange.worker.stopped):
            return
        if not exchange.outer.stop_requested:
            log.info("rank 0 stops: its worker's ranks stop together at the end of its round (%d step(s) left);"
                     " the other workers at their next exchange.", exchange.worker.round_steps
                     - exchange.worker.steps_in_round)
        exchange.outer.request_stop()
        trainer.should_stop = False


class StopAtRoundEnd(Callback):
    """Installed by the strategy: rank 0's stop decisions go through :meth:`RankGroups.stop_at_round_end`."""

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, RankGroups):
            trainer.strategy.stop_at_round_end(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.on_validation_end(trainer, pl_module)

    on_train_epoch_end = on_validation_end
