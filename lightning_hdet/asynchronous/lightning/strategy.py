"""Asynchronous Local-SGD and DiLoCo for Lightning: the glue between Lightning's hooks and the exchange
(``docs/async.md``, "How it is built"). Rank 0 alone validates, decides and writes checkpoints."""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import require
from lightning_hdet._compat import (
    StrategyRegistry,
    attached_trainer,
    default_store,
    ensure_callback,
    register_names,
    strategy_timeout,
    sync_module_states,
)
from lightning_hdet._launch import HandingBackLauncher, handing_back
from lightning_hdet._process_groups import destroy_default_group_at_exit, destroy_groups
from lightning_hdet.asynchronous.exchange.exchange import Exchange, read_model
from lightning_hdet.asynchronous.exchange.worker_shards import check_inside_worker, read_full, read_sharded_model
from lightning_hdet.asynchronous.lightning.callback import AsyncLogging
from lightning_hdet.asynchronous.lightning.checkpoints import WorkerCheckpoints
from lightning_hdet.asynchronous.lightning.worker_shape import (
    WorkerShape,
    check_exchange_options,
    refuse_shape_arguments,
)
from lightning_hdet.asynchronous.lightning.limits import LoopLimits
from lightning_hdet.asynchronous.lightning.readouts import ExchangeReadouts
from lightning_hdet.asynchronous.lightning.validation_score import validation_score
from lightning_hdet.asynchronous.lightning.shard_hooks import (
    ShardedWorkersLauncher,
    check_ddp_hooks,
    check_names_of,
    check_sharded_entry,
    ddp_arguments,
)
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.local_steps import AdaptiveSteps
from lightning_hdet.asynchronous.outer.lookahead import refuse_lookahead
from lightning_hdet.asynchronous.outer.momentum import refuse_moved
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import Codec, codec_numbers
from lightning_hdet.asynchronous.wire.messages import Kind
from lightning_hdet.asynchronous.wire.network import Transport, check_transport
from lightning_hdet.records import History

log = logging.getLogger(__name__)

Mode = Literal["async", "sync"]


class AsyncLocalSGDStrategy(ExchangeReadouts, WorkerCheckpoints):
    """Asynchronous Local-SGD for devices of unequal speed, and synchronous DiLoCo (``mode="sync"``): each worker (a
    rank, or several training as DDP or FSDP2 inside) runs the user's optimizer for a round of local steps, then
    exchanges its pseudo-gradient with the outer optimizer on rank 0. ``Trainer(max_steps=S)`` is a sample budget:
    ``workers * S`` inner steps in all (fast workers do more of them).

    Args (every default and allowed value: ``docs/configuration.md``):
        local_steps: an integer ``H``: every round ``H`` inner steps, in either mode; async only,
            ``AdaptiveSteps(start, min, grace_period, smoothing)``: ``start`` for the fastest worker, slower ones
            proportionally fewer. ``None`` (default): ``AdaptiveSteps()`` in async mode, 50 in DiLoCo.
        mode: ``"async"`` (apply each push on arrival) or ``"sync"`` (DiLoCo: mean of all workers' pushes).
        outer: ``DelayedNesterov(...)``, ``Nesterov(...)``, ``SparseLoCo(...)``, or a preset that builds one
            (``"stable"``, the default, ``"published"``, ``"robust"``, ``"sparseloco"``); :attr:`config` shows it.
        compression: the pushes' codec: ``NoCodec()``, ``BF16()``, ``Int8()``, ``TopK(fraction, bits)``, or a
            preset (``"none"``, ``"bf16"``, ``"int8"``, ``"topk2"``, ``"topk4"``).
        pull_compression: the pulls' codec: the global model (``"none"``, ``"bf16"``), its changes (``"int8"``), or
            with ``SparseLoCo`` its rounds' pushes (``compression``'s TopK codec). See ``docs/async.md``.
        error_feedback: each worker adds what its codec lost to its next push (default: on with a lossy codec).
        check_pushes: ``True`` (``PushCheck()``), a ``PushCheck(max_norm_ratio, max_rejections)`` or ``False``: a
            bad push is discarded whole and its worker restarts from the global model.
        checkpoint_inner_states: every exchange also sends the worker's inner optimizer state to rank 0; False
            (default): each worker writes its own file beside every checkpoint.
        worker: what one worker is (:class:`~.worker_shape.WorkerShape`): its ranks and how it exchanges.
        transport: what carries pushes and pulls: ``PointToPoint()`` (default, gloo), ``SlowLink(...)`` or another
            engine's :class:`~lightning_hdet.Transport` (``docs/architecture.md``, "How to plug in a transport").
        **kwargs: :class:`~lightning.pytorch.strategies.DDPStrategy`'s (its ``timeout`` also bounds the exchange),
            and DDP's with workers of several ranks only; any other name is refused.
    """

    strategy_name = "async_local_sgd"

    def __init__(self, local_steps: int | AdaptiveSteps | None = None, mode: Mode = "async",
                 outer: OuterOptimizer | str | None = None, compression: Codec | str = "none",
                 pull_compression: Codec | str = "none", error_feedback: bool | None = None,
                 check_pushes: PushCheck | bool = True, checkpoint_inner_states: bool = False,
                 worker: WorkerShape | None = None, transport: Transport | None = None, **kwargs: Any) -> None:
        refuse_moved(type(self).__name__, kwargs)
        refuse_shape_arguments(type(self).__name__, kwargs)
        shape = WorkerShape() if worker is None else worker
        require("worker", shape, isinstance(shape, WorkerShape), "a WorkerShape(...) or None")
        check_names_of(type(self), kwargs, shape.ranks_per_worker)  # a misspelled name before any value's check
        self.outer_settings = OuterSettings(mode, local_steps, outer, check_pushes, shape.stagger)
        self.compression, self.pull_compression, self.error_feedback = check_exchange_options(
            self.outer_settings, compression, error_feedback, pull_compression, shape.overlap_steps,
            shape.ranks_per_worker)
        check_inside_worker(shape.inside_worker, shape.ranks_per_worker, checkpoint_inner_states,
                            ddp_arguments(kwargs), shape.auto_wrap_policy)
        if shape.inside_worker == "fsdp":
            refuse_lookahead(self.outer_settings.outer, "FSDP inside a worker", "Rank 0 holds one shard to score on.")
        check_ddp_hooks(kwargs, shape.ranks_per_worker)
        super().__init__(**kwargs)
        self.worker_shape = shape
        self.ranks_per_worker, self.overlap_steps = shape.ranks_per_worker, shape.overlap_steps
        self.inside_worker, self.auto_wrap_policy = shape.inside_worker, shape.auto_wrap_policy
        self.checkpoint_inner_states = checkpoint_inner_states
        self.transport = check_transport(transport)
        # Only plain settings here (and the transport, a factory): the strategy crosses spawn before set-up.
        self._resume_state: dict[str, Any] | None = None
        self._groups: tuple[Any, Any] | None = None
        self.report = History()  # the outer metrics rank 0 logged, for the figures at the end of fit
        self._reset_run_state()

    @property
    def mode(self) -> str:
        """``"async"`` or ``"sync"`` (DiLoCo)."""
        return self.outer_settings.mode

    @property
    def config(self) -> dict[str, Any]:
        """Every setting in force, the objects' numbers included (the run config's ``async/...``)."""
        return {**self.outer_settings.numbers(), **codec_numbers("compression", self.compression),
                **codec_numbers("pull_compression", self.pull_compression), "error_feedback": self.error_feedback,
                "checkpoint_inner_states": self.checkpoint_inner_states, **self.worker_shape.numbers(),
                "transport": repr(self.transport), "workers": self._workers}

    def _reset_run_state(self) -> None:
        self.training_apart = False
        self.left_exchange = False  # True from leave_exchange until the next fit
        self._exchange: Exchange | None = None
        self._budget: int | None = None
        self._limits = LoopLimits()

    # set-up
    @property
    def _workers(self) -> int:
        return self.num_nodes * self.num_processes // self.ranks_per_worker

    @override
    def _configure_launcher(self) -> None:
        world_size = self.num_nodes * self.num_processes
        if world_size < 2:
            raise ValueError(f"{type(self).__name__} needs at least 2 processes (got devices={self.num_processes},"
                             f" num_nodes={self.num_nodes}); use a single-device strategy for one process.")
        self.check_worker_layout()
        self.outer_settings.outer.check_workers(self._workers)
        super()._configure_launcher()
        self._launcher = handing_back(self, self._launcher,
                                      ShardedWorkersLauncher if self.inside_worker == "fsdp" else HandingBackLauncher)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        """Attach the model and the :class:`AsyncLogging` callback (progress bar, run config, figures), first."""
        if self.inside_worker == "fsdp":
            check_sharded_entry(model)
        super().connect(model)
        ensure_callback(model, AsyncLogging, first=True)  # its on_train_end leaves the exchange before the others

    @override
    def configure_ddp(self) -> None:
        """Start every worker from rank 0's parameters and buffers; DDP only inside a worker of several ranks."""
        assert self.model is not None
        sync_module_states(self.model)
        self.wrap_worker_ddp()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._reset_run_state()
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one (inner) optimizer, got {len(self.optimizers)}.")
        # Only fit exchanges: the groups live from here to this entry's teardown (validate, test, predict create none).
        rank_zero_info(f"{type(self).__name__}: creating the exchange process groups ({self.mode} mode)")
        timeout = strategy_timeout(self)
        self._groups = (dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout))
        destroy_default_group_at_exit()
        # Budget: inner steps summed over workers = workers * max_steps. The loop itself must not stop a fast
        # worker at max_steps, so the strategy stops it (trainer.should_stop) instead.
        max_steps = trainer.fit_loop.max_steps
        self._budget = self._workers * max_steps if max_steps >= 0 else None
        self._limits.lift(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data is sharded as in DDP; during ``fit``, validation data is not (rank 0 validates)."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    # training: one round per exchange
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module, device, outer, ranks, read = self.lightning_module, self.root_device, None, self.worker_ranks, read_model
        if self.shard_group is not None and ranks.worker == 0:  # rank 0 gathers the full model with its worker
            if self.is_global_zero:
                read = read_sharded_model
            else:
                read_full(list(module.parameters()), None, device)
        if self.is_global_zero:
            score = validation_score(module, self.outer_settings.outer.lookahead, device, self.batch_to_device)
            outer = Exchange.start_outer(self.outer_settings, module, device, self._workers, self._budget,
                                         self._resume_state, read, score)
            self._resume_state, self._logged_version = None, -1
        elif self.shard_group is None or ranks.worker != 0:  # with FSDP inside, worker 0's ranks validate together
            module.trainer.limit_val_batches = 0  # only rank 0 validates, with the global model
        assert self._groups is not None
        inner = self.optimizers[0] if self.checkpoint_inner_states else None
        self._exchange = Exchange(module, device, self._groups, self._workers, strategy_timeout(self).total_seconds(),
                                  inner, outer, self.compression, self.error_feedback, self.pull_compression,
                                  self.optimizers[0], self.outer_settings.check_pushes is not None, ranks,
                                  self.exchange_group, self.overlap_steps, self.shard_group, self.outer_settings.outer,
                                  self.outer_settings.stagger, self.transport)
        self._exchange.worker.name = ranks.describe()
        self.restore_worker(self._exchange.worker)
        if not self.checkpoint_inner_states:  # else the states travel with the pushes and rank 0's file holds them
            self.follow_checkpoints(default_store(), keep=bool(module.trainer.checkpoint_callbacks))
        self.train_apart(True)
        self._run_exchange(Kind.HELLO)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._exchange is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with self._exchange.worker.inner_lr(optimizer):  # cut after rejected pushes in a row
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.training_apart and not self.left_exchange:
            if self._exchange.worker.step():
                self._run_exchange(Kind.PUSH)
            if self._exchange.worker.stopped:  # the budget is spent: this step's hooks see the final global model
                self.leave_exchange()
            self._log_outer_metrics()
        return output

    def _run_exchange(self, kind: Kind) -> None:
        """One exchange of this worker; a reply without steps stops its training loop."""
        assert self._exchange is not None
        worker = self._exchange.worker
        worker.exchange(kind)
        self.after_exchange()
        if worker.stopped:
            log.debug("rank %d: stop", self.global_rank)
            self.lightning_module.trainer.should_stop = True
        else:
            log.debug("rank %d: round start, %d step(s)", self.global_rank, worker.round_steps)

    def leave_exchange(self) -> None:
        """Leave the exchange (rank 0 waits for every worker); every rank then holds the final global model. Once,
        at the step whose reply said stop or (e.g. EarlyStopping) first in ``on_train_end`` (:class:`AsyncLogging`),
        so that the last step's callbacks see the global model; collectives stay local until ``on_train_end``."""
        if not self.training_apart or self.left_exchange:
            return
        assert self._exchange is not None and self._groups is not None
        log.debug("rank %d: leaving the exchange", self.global_rank)
        self._exchange.leave(stop_everyone=self.lightning_module.trainer.should_stop)  # e.g. EarlyStopping on rank 0
        self.left_exchange = True
        self._log_outer_metrics()
        if self.shard_group is not None:
            self._exchange.share_global_model(self._groups[1])
        else:
            sync_module_states(self.lightning_module)

    @override
    def on_train_end(self) -> None:
        """Leave the exchange if not yet done, follow rank 0's last checkpoint requests; collectives meet again."""
        if self.training_apart:
            self.leave_exchange()
            self.train_apart(False)
            self.finish_checkpoints(self._groups)
            self._limits.restore(self.lightning_module)
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.train_apart(False)
        self._limits.restore(self.lightning_module)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Release what this entry created, on every path: rank 0's server threads, then the exchange groups (the
        default group stays up for the next entry). The read-outs (``rounds``, ``worker_stats()``, ...) stay."""
        if self._exchange is not None:
            self._exchange.close()
        groups, self._groups = self._groups, None
        destroy_groups(groups or ())
        self.release_worker_groups()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register the async and DiLoCo names (subprocess and spawn launchers) without replacing existing ones."""
        register_names(strategy_registry, cls, [
            (name, f"{'Asynchronous Local-SGD' if mode == 'async' else 'DiLoCo'} with start_method '{method}'",
             {"mode": mode, "start_method": method})
            for name, method, mode in (("async_local_sgd", "popen", "async"), ("async_local_sgd_spawn", "spawn", "async"),
                                       ("diloco", "popen", "sync"), ("diloco_spawn", "spawn", "sync"))
        ])
