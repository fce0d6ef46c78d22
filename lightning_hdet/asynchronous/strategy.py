"""Asynchronous Local-SGD (Delayed Nesterov + dynamic local steps) and synchronous DiLoCo for Lightning.

Every process is a *worker*: it trains with the user's own (inner) optimizer for a round of local steps,
then exchanges ``theta_pulled - theta_local`` (the pseudo-gradient) for the newest global parameters.
The outer optimizer -- global parameters and momentum in host memory -- lives on rank 0, served by a
background thread over a dedicated ``gloo`` process group (point-to-point messages, received from any
worker). Rank 0 also trains; its own exchanges go through an in-process queue.

* ``mode="async"``: each push is applied on arrival (Delayed Nesterov or plain Nesterov); no worker ever
  waits for another one, only for its own exchange.
* ``mode="sync"`` (DiLoCo): the server waits for every worker's push, averages them and applies one
  Nesterov-SGD step.

While training, Lightning's collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``,
``reduce_boolean_decision``) are answered locally, because workers are at different step counts.
Rank 0 is the only rank that validates (with the global parameters, on the whole validation set),
decides (early stopping, best checkpoints) and writes checkpoints (with the global parameters and the outer
state); its stop decision reaches the other workers in their next exchange. See ``docs/async.md``.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import Tensor
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import SGD, Optimizer

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._compat import (
    StrategyRegistry,
    attached_trainer,
    ensure_callback,
    register_names,
    set_loop_max_steps,
    strategy_timeout,
    sync_module_states,
)
from lightning_hdet._tensors import state_from_bytes, state_to_bytes
from lightning_hdet._checks import is_finite_number
from lightning_hdet.asynchronous.delayed_nesterov import DelayedNesterov, validate_outer_hyperparameters
from lightning_hdet.asynchronous.local_steps import LocalStepsPolicy, validate_local_steps
from lightning_hdet.records import History, log_report_figures
from lightning_hdet.records.wandb import finish_worker_run, record_config

Mode = Literal["async", "sync"]
_MODES = ("async", "sync")
_CHECKPOINT_KEY = "async_local_sgd"

# Worker -> server header: [kind, steps, compute_s, wait_s, inner_state_bytes]. When steps > 0, one flat
# float32 message follows: the pseudo-gradient of the parameters, then the current values of the
# floating-point buffers; then the serialized inner optimizer state when inner_state_bytes > 0.
# Server -> worker header: [next_local_steps (0 = stop), outer_updates]; when next_local_steps > 0 the flat
# global parameters follow, then (if the model has floating-point buffers) the flat global buffers.
_HELLO, _PUSH, _BYE = 0.0, 1.0, 2.0
_WORKER_HEADER, _SERVER_HEADER = 5, 2


@dataclass
class _Push:
    worker: int
    kind: float
    steps: int
    compute_s: float
    wait_s: float
    pseudo_gradient: Tensor | None
    inner_state: Tensor | None = None  # the worker's serialized inner optimizer state (uint8), if sent
    buffers: Tensor | None = None  # the worker's floating-point buffers (flat values), if sent


@dataclass
class _WorkerStats:
    steps_per_s: float = 0.0
    local_steps: int = 0
    staleness: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    rounds: int = 0
    steps: int = 0
    pulled_version: int = 0
    in_flight: int = 0


@dataclass
class _OuterState:
    """The outer optimizer's side: global parameters and buffers, outer optimizer, speeds, budget, counters.

    The outer optimizer steps on the parameters only. The global floating-point buffers (e.g. BatchNorm
    running statistics) are the mean of the latest values pushed by each worker that has pushed so far.
    """

    params: Tensor
    optimizer: Optimizer
    policy: LocalStepsPolicy
    mode: Mode
    budget: int | None
    steps_done: int = 0
    outer_updates: int = 0
    stop_requested: bool = False
    workers: dict[int, _WorkerStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    metrics_version: int = 0
    #: Each worker's serialized inner optimizer state as of its latest exchange (when workers send it).
    inner_states: dict[int, Tensor] = field(default_factory=dict)
    #: The global floating-point buffers, flat (empty for a model without any).
    buffers: Tensor = field(default_factory=lambda: torch.zeros(0))
    #: Each worker's floating-point buffers as of its latest push.
    worker_buffers: dict[int, Tensor] = field(default_factory=dict)

    def process(self, pushes: list[_Push]) -> dict[int, int]:
        """Apply a batch of pushes (one at a time in async mode, their mean in sync mode) and return the
        next round's local step count for each worker that waits for a reply (0 means stop)."""
        with self.lock:
            for push in pushes:
                stats = self.workers.setdefault(push.worker, _WorkerStats())
                stats.in_flight = 0
                stats.compute_s, stats.wait_s = push.compute_s, push.wait_s
                if push.inner_state is not None:
                    self.inner_states[push.worker] = push.inner_state
                if push.buffers is not None:
                    self.worker_buffers[push.worker] = push.buffers
                if push.steps > 0:
                    stats.staleness = self.outer_updates - stats.pulled_version
                    stats.rounds += 1
                    stats.steps += push.steps
                    self.steps_done += push.steps
                    self.policy.update(push.worker, push.steps, push.compute_s)
                    stats.steps_per_s = self.policy.speeds.get(push.worker, 0.0)
            if any(p.buffers is not None for p in pushes):
                self.buffers.copy_(torch.stack(list(self.worker_buffers.values())).mean(0))
            grads = [p.pseudo_gradient for p in pushes if p.pseudo_gradient is not None]
            if self.mode == "sync" and grads:
                self._outer_step(torch.stack(grads).mean(0))
            elif self.mode == "async":
                for g in grads:
                    self._outer_step(g)
            waiting = [p.worker for p in pushes if p.kind != _BYE]
            replies = {w: self._allocate(w, len(waiting)) for w in waiting}
            for w in waiting:
                self.workers[w].pulled_version = self.outer_updates
            self.metrics_version += 1
            return replies

    def _outer_step(self, pseudo_gradient: Tensor) -> None:
        self.params.grad = pseudo_gradient.to(self.params.dtype)
        self.optimizer.step()
        self.params.grad = None
        self.outer_updates += 1

    def _allocate(self, worker: int, n_waiting: int) -> int:
        stats = self.workers[worker]
        if self.stop_requested:
            steps = 0
        elif self.mode == "sync":
            steps = self.policy.local_steps
            if self.budget is not None:
                steps = min(steps, (self.budget - self.steps_done) // n_waiting)
        else:
            steps = self.policy.next_local_steps(worker)
            if self.budget is not None:
                in_flight = sum(s.in_flight for w, s in self.workers.items() if w != worker)
                steps = min(steps, self.budget - self.steps_done - in_flight)
        stats.in_flight = max(steps, 0)
        if steps > 0:
            stats.local_steps = steps
        return stats.in_flight

    def metrics(self) -> dict[str, float]:
        """The logged metrics (keys fixed by the project; see docs/async.md)."""
        with self.lock:
            out: dict[str, float] = {"async/outer_updates": float(self.outer_updates)}
            for w, s in sorted(self.workers.items()):
                for name in ("steps_per_s", "local_steps", "staleness", "compute_s", "wait_s", "rounds"):
                    out[f"async/worker{w}/{name}"] = float(getattr(s, name))
            return out

    def state_dict(self) -> dict[str, Any]:
        """A consistent snapshot; ``inner_optimizer_states`` holds the inner states the workers sent and
        ``worker_buffers`` the buffers they pushed, each as of that worker's latest exchange (the one counted
        in ``workers[w]["steps"]``)."""
        with self.lock:
            state = {
                "params": self.params.detach().clone(),
                "buffers": self.buffers.clone(),
                "worker_buffers": {w: b.clone() for w, b in sorted(self.worker_buffers.items())},
                "optimizer": self.optimizer.state_dict(),
                "policy": self.policy.state_dict(),
                "mode": self.mode,
                "steps_done": self.steps_done,
                "outer_updates": self.outer_updates,
                "workers": {w: dict(vars(s)) for w, s in self.workers.items()},
            }
            inner = dict(self.inner_states)  # the stored tensors are replaced, never modified
        state["inner_optimizer_states"] = {w: state_from_bytes(data) for w, data in sorted(inner.items())}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; one saved before buffers were exchanged (no ``buffers``) keeps the
        current global buffers (the model's own)."""
        with self.lock:
            for key, name, own in (("params", "parameters", self.params),
                                   ("buffers", "floating-point buffer values", self.buffers)):
                if key in state and state[key].numel() != own.numel():
                    raise ValueError(
                        f"The checkpoint's outer state holds {state[key].numel()} {name} but the model has"
                        f" {own.numel()}."
                    )
            self.params.data.copy_(state["params"])
            if "buffers" in state:
                self.buffers.copy_(state["buffers"])
                self.worker_buffers = {int(w): b.float().clone() for w, b in state["worker_buffers"].items()}
            self.optimizer.load_state_dict(state["optimizer"])
            self.policy.load_state_dict(state["policy"])
            self.steps_done = int(state["steps_done"])
            self.outer_updates = int(state["outer_updates"])
            self.workers = {int(w): _WorkerStats(**{**s, "in_flight": 0}) for w, s in state["workers"].items()}


class _Server:
    """Rank 0's exchange service: a receiver thread (pushes from remote workers) and a server thread (applies
    pushes and replies). Rank 0's own worker talks to it through queues."""

    def __init__(
        self, outer: _OuterState, world_size: int, push_group: Any, reply_group: Any, grace_period: float, timeout: float
    ) -> None:
        self.outer = outer
        self.world_size = world_size
        self.push_group, self.reply_group = push_group, reply_group
        self.grace_period, self.timeout = grace_period, timeout
        self.inbox: queue.Queue[_Push] = queue.Queue()
        self.local_replies: queue.Queue[tuple[int, Tensor | None]] = queue.Queue()
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._guard, args=(self._receive,), name="async-local-sgd-receiver", daemon=True),
            threading.Thread(target=self._guard, args=(self._serve,), name="async-local-sgd-server", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join(self.timeout)
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError("The asynchronous Local-SGD server on rank 0 failed.") from self.error

    def _guard(self, target: Any) -> None:
        try:
            target()
        except BaseException as err:  # reported to the training thread
            self.error = err
            self.local_replies.put((0, None))

    def _receive(self) -> None:
        remaining = self.world_size - 1
        n_params, n_buffers = self.outer.params.numel(), self.outer.buffers.numel()
        while remaining:
            header = torch.empty(_WORKER_HEADER, dtype=torch.float64)
            src = dist.recv(header, src=None, group=self.push_group)
            kind, steps, compute_s, wait_s, state_bytes = header.tolist()
            payload = inner_state = buffers = None
            if steps > 0:
                payload = torch.empty(n_params + n_buffers, dtype=torch.float32)
                dist.recv(payload, src=src, group=self.push_group)
                if n_buffers:  # a copy: the server keeps it; the pseudo-gradient need not stay alive with it
                    buffers = payload[n_params:].clone()
                payload = payload[:n_params]
            if state_bytes > 0:
                inner_state = torch.empty(int(state_bytes), dtype=torch.uint8)
                dist.recv(inner_state, src=src, group=self.push_group)
            remaining -= kind == _BYE
            self.inbox.put(_Push(src, kind, int(steps), compute_s, wait_s, payload, inner_state, buffers))

    def _serve(self) -> None:
        active = set(range(self.world_size))
        while active:
            batch = [self.inbox.get(timeout=self.timeout)]
            if self.outer.mode == "sync":
                while len(batch) < len(active):
                    batch.append(self.inbox.get(timeout=self.timeout))
            else:
                # Pushes within the grace window join the batch; the window closes early once every active
                # worker is in it (each waits for its reply, so no further push can come).
                deadline = time.monotonic() + self.grace_period
                while len(batch) < len(active) and (left := deadline - time.monotonic()) > 0:
                    try:
                        batch.append(self.inbox.get(timeout=left))
                    except queue.Empty:
                        break
            replies = self.outer.process(batch)
            active -= {p.worker for p in batch if p.kind == _BYE}
            for worker, steps in replies.items():
                self._reply(worker, steps)

    def _reply(self, worker: int, steps: int) -> None:
        params, buffers = self.outer.params.detach(), self.outer.buffers
        if worker == 0:
            self.local_replies.put((steps, torch.cat([params, buffers]) if steps else None))
            return
        header = torch.tensor([steps, self.outer.outer_updates], dtype=torch.float64)
        dist.send(header, dst=worker, group=self.reply_group)
        if steps:
            dist.send(params, dst=worker, group=self.reply_group)
            if buffers.numel():
                dist.send(buffers, dst=worker, group=self.reply_group)


class AsyncLocalSGDStrategy(DDPStrategy):
    """Asynchronous Local-SGD for devices of unequal speed, and synchronous DiLoCo (``mode="sync"``).

    The model is never wrapped in DDP and gradients are never all-reduced: each worker runs the user's
    optimizer and schedulers locally for a round of local steps, then exchanges its pseudo-gradient with the
    outer optimizer on rank 0. ``Trainer(max_steps=S)`` is a sample budget: inner steps summed over all
    workers equal ``world_size * S`` (fast workers do more of them).

    Args:
        local_steps: ``H``, inner steps per round (of the fastest worker when ``dynamic_local_steps``).
        mode: ``"async"`` (apply each push on arrival) or ``"sync"`` (DiLoCo: mean of all workers' pushes).
        outer_lr: outer learning rate (DiLoCo's published value 0.7).
        outer_momentum: outer Nesterov momentum in [0, 1) (0.9).
        delayed_nesterov: async only; Delayed Nesterov (True) or plain Nesterov SGD (False).
        buffer_size: ``N`` for Delayed Nesterov; default: the number of workers.
        momentum_activation: ``c`` in [0, 1/N] for Delayed Nesterov (0).
        dynamic_local_steps: async only; give slower workers proportionally fewer local steps.
        min_local_steps: lower bound of a worker's round length (1).
        grace_period: async only; pushes arriving within this many seconds of a batch's first one are applied
            one after another as one batch, and those workers restart from the same parameters; the window
            closes early once every worker still training has pushed (0: each push alone).
        speed_smoothing: weight of the previous measurement in each worker's steps/s moving average.
        checkpoint_inner_states: every exchange also sends the worker's inner optimizer state to rank 0, so that
            every checkpoint holds each worker's state as of its latest exchange and each worker resumes its own
            (True). This adds the optimizer state's size to each push (AdamW: twice the model). With False only
            pseudo-gradients travel: checkpoints written during training hold rank 0's inner state only, which
            the other workers then resume from; those written after ``fit`` hold every worker's.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``timeout``, ``start_method``,
            ``cluster_environment``, ...). The exchange group uses the same ``timeout``, which must exceed the
            longest round.
    """

    strategy_name = "async_local_sgd"
    _training_phase = False

    def __init__(
        self,
        local_steps: int = 50,
        mode: Mode = "async",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        delayed_nesterov: bool = True,
        buffer_size: int | None = None,
        momentum_activation: float = 0.0,
        dynamic_local_steps: bool = True,
        min_local_steps: int = 1,
        grace_period: float = 0.0,
        speed_smoothing: float = 0.5,
        checkpoint_inner_states: bool = True,
        **kwargs: Any,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")
        validate_local_steps(local_steps, min_local_steps)
        validate_outer_hyperparameters(outer_lr, outer_momentum, 1 if buffer_size is None else buffer_size, momentum_activation)
        if not is_finite_number(grace_period) or grace_period < 0:
            raise ValueError(f"`grace_period` must be a finite number of seconds >= 0, got {grace_period!r}.")
        for name, value in (("buffer_size", buffer_size), ("momentum_activation", momentum_activation or None)):
            if value is not None and (mode != "async" or not delayed_nesterov):
                raise ValueError(
                    f"`{name}`={value!r} applies only to Delayed Nesterov (mode='async', delayed_nesterov=True), "
                    f"got mode={mode!r}, delayed_nesterov={delayed_nesterov!r}."
                )
        if "ddp_comm_hook" in kwargs or "model_averaging_period" in kwargs:
            raise ValueError("`ddp_comm_hook` / `model_averaging_period` do not apply: the model is not wrapped in DDP.")
        super().__init__(**kwargs)
        self.local_steps = local_steps
        self.mode: Mode = mode
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.delayed_nesterov = delayed_nesterov
        self.buffer_size = buffer_size
        self.momentum_activation = momentum_activation
        self.dynamic_local_steps = dynamic_local_steps
        self.min_local_steps = min_local_steps
        self.grace_period = grace_period
        self.speed_smoothing = speed_smoothing
        self.checkpoint_inner_states = checkpoint_inner_states
        LocalStepsPolicy(local_steps, min_local_steps, dynamic_local_steps, speed_smoothing)  # validates smoothing
        self._resume_state: dict[str, Any] | None = None
        self._groups: tuple[Any, Any] | None = None
        self.report = History()  # the outer metrics rank 0 logged, for the figures at the end of fit
        self._reset_run_state()

    @property
    def config(self) -> dict[str, Any]:
        """The settings, as recorded in the logger's run config under ``async/...``."""
        return {
            "mode": self.mode, "local_steps": self.local_steps, "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "delayed_nesterov": self.delayed_nesterov,
            "buffer_size": self.buffer_size, "momentum_activation": self.momentum_activation,
            "dynamic_local_steps": self.dynamic_local_steps, "min_local_steps": self.min_local_steps,
            "grace_period": self.grace_period, "checkpoint_inner_states": self.checkpoint_inner_states,
            "workers": self._expected_world_size,
        }

    def _reset_run_state(self) -> None:
        self._training_phase = False
        self._server: _Server | None = None
        self._outer: _OuterState | None = None
        self._inner_states: dict[int, Any] | None = None
        self._budget: int | None = None
        self._saved_limits: tuple[Any, Any] | None = None
        self._stopped_by_server = False
        #: This worker's own history: one entry per round, ``(local_steps_assigned, outer_updates_seen)``.
        self.rounds: list[tuple[int, int]] = []
        self.inner_steps = 0

    # ------------------------------------------------------------------ set-up
    @property
    def _expected_world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def _configure_launcher(self) -> None:
        if self._expected_world_size < 2:
            raise ValueError(
                f"{type(self).__name__} needs at least 2 processes (got devices={self.num_processes},"
                f" num_nodes={self.num_nodes}); use a single-device strategy for one process."
            )
        n = self.buffer_size or self._expected_world_size
        if n > self._expected_world_size:
            raise ValueError(
                f"`buffer_size={n}` is larger than the number of workers ({self._expected_world_size}); allowed: "
                f"1..{self._expected_world_size}. Delayed Nesterov averages N pushes into one momentum update, and "
                "N beyond one push per worker only delays momentum (the natural choice is the number of workers)."
            )
        validate_outer_hyperparameters(self.outer_lr, self.outer_momentum, n, self.momentum_activation)
        super()._configure_launcher()

    def connect(self, model: pl.LightningModule) -> None:
        """Attach the model and the :class:`AsyncLogging` callback (progress bar, run config, figures)."""
        super().connect(model)
        ensure_callback(model, AsyncLogging)

    def setup_distributed(self) -> None:
        super().setup_distributed()
        rank_zero_info(f"{type(self).__name__}: creating the exchange process groups ({self.mode} mode)")
        timeout = strategy_timeout(self)
        # Two gloo groups: one carries pushes to rank 0, one carries replies, so that rank 0's receiver and
        # server threads never share a group.
        self._groups = (dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout))

    def configure_ddp(self) -> None:
        """No DDP wrapper (no gradient all-reduce); start every worker from rank 0's parameters and buffers."""
        assert self.model is not None
        sync_module_states(self.model)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._reset_run_state()
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one (inner) optimizer, got {len(self.optimizers)}.")
        # Budget semantics: inner steps summed over workers = world_size * max_steps. The loop itself must
        # not stop a fast worker at max_steps, so the strategy stops it (trainer.should_stop) instead.
        self._workers = self.world_size
        max_steps = trainer.fit_loop.max_steps
        self._budget = self._workers * max_steps if max_steps >= 0 else None
        self._saved_limits = (max_steps, trainer.limit_val_batches)
        set_loop_max_steps(trainer, -1)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data is sharded as in DDP; during ``fit``, validation data is not (rank 0 validates)."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    # ------------------------------------------------------------------ flat host buffers
    def _params(self) -> list[Tensor]:
        return list(self.lightning_module.parameters())

    def _buffers(self) -> list[Tensor]:
        """The floating-point buffers, which the exchange carries (integer ones, e.g. counters, stay put)."""
        return [b for b in self.lightning_module.buffers() if torch.is_floating_point(b)]

    def _model_state(self) -> list[Tensor]:
        """What the exchange carries, in this order: the parameters, then the floating-point buffers."""
        return self._params() + self._buffers()

    def _host_buffer(self, numel: int) -> Tensor:
        return torch.zeros(numel, dtype=torch.float32, pin_memory=self.root_device.type == "cuda")

    def _sync_stream(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.current_stream(self.root_device).synchronize()

    @torch.no_grad()
    def _read(self, tensors: list[Tensor], out: Tensor) -> Tensor:
        """Copy ``tensors`` (on the device) into the flat host buffer ``out``, in order."""
        offset = 0
        for t in tensors:
            out[offset : offset + t.numel()].copy_(t.reshape(-1), non_blocking=True)
            offset += t.numel()
        self._sync_stream()
        return out

    @torch.no_grad()
    def _write(self, tensors: list[Tensor], flat: Tensor) -> None:
        """Copy the flat host buffer ``flat`` into ``tensors`` (on the device), in order."""
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t), non_blocking=True)
            offset += t.numel()
        self._sync_stream()

    # ------------------------------------------------------------------ training phase
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        self._n_params = sum(p.numel() for p in self._params())
        numel = self._n_params + sum(b.numel() for b in self._buffers())
        self._pulled = self._host_buffer(numel)  # theta_pulled, then the pulled global buffers
        self._local = self._host_buffer(numel)  # the push: pseudo-gradient, then this worker's buffers
        if self.is_global_zero:
            self._start_server()
        else:
            trainer.limit_val_batches = 0  # only rank 0 validates, with the global model
        self._training_phase = True
        self._round_steps = 0
        self._steps_in_round = 0
        self._wait_s = 0.0
        self._round_start = time.perf_counter()
        self._exchange(_HELLO)

    def _start_server(self) -> None:
        params = self._read(self._params(), self._host_buffer(self._n_params))
        params.requires_grad_(False)
        buffers = self._read(self._buffers(), self._host_buffer(self._local.numel() - self._n_params))
        if self.mode == "async" and self.delayed_nesterov:
            n = self.buffer_size or self._workers
            optimizer: Optimizer = DelayedNesterov(
                [params], lr=self.outer_lr, momentum=self.outer_momentum, buffer_size=n,
                momentum_activation=self.momentum_activation,
            )
        else:
            optimizer = SGD([params], lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
        dynamic = self.dynamic_local_steps and self.mode == "async"
        policy = LocalStepsPolicy(self.local_steps, self.min_local_steps, dynamic, self.speed_smoothing)
        self._outer = _OuterState(params, optimizer, policy, self.mode, self._budget, buffers=buffers)
        if self._resume_state is not None:
            self._outer.load_state_dict(self._resume_state)
            self._resume_state = None
            # a run resumed on fewer workers: the missing workers' buffers no longer count in the mean
            kept = {w: b for w, b in self._outer.worker_buffers.items() if w < self._workers}
            self._outer.worker_buffers = kept
        assert self._groups is not None
        timeout = strategy_timeout(self).total_seconds()
        self._server = _Server(self._outer, self._workers, *self._groups, self.grace_period, timeout)
        self._server.start()
        self._logged_version = -1

    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._training_phase:
            self._steps_in_round += 1
            self.inner_steps += 1
            if self._steps_in_round >= self._round_steps:
                self._exchange(_PUSH)
            self._log_outer_metrics()
        return output

    def _exchange(self, kind: float) -> None:
        """Push this round's pseudo-gradient and floating-point buffers (if any steps were taken) and this
        worker's inner optimizer state (with ``checkpoint_inner_states``) and, unless leaving, pull the new
        global parameters and buffers and the next round's length."""
        compute_s = time.perf_counter() - self._round_start
        steps = self._steps_in_round
        payload = None
        n = self._n_params
        if steps > 0:
            payload = self._read(self._model_state(), self._local)
            torch.sub(self._pulled[:n], payload[:n], out=payload[:n])  # the buffers travel as values
        start = time.perf_counter()  # serializing the inner state counts as exchange time
        # serialized now: a snapshot, since the optimizer keeps updating its tensors in place
        inner_state = state_to_bytes(self.optimizers[0].state_dict()) if self.checkpoint_inner_states else None
        state_bytes = inner_state.numel() if inner_state is not None else 0
        header = [kind, float(steps), compute_s, self._wait_s, float(state_bytes)]
        if self.is_global_zero:
            assert self._server is not None
            self._server.raise_error()
            pseudo_gradient = payload[:n].clone() if payload is not None else None
            buffers = payload[n:].clone() if payload is not None and payload.numel() > n else None
            self._server.inbox.put(
                _Push(0, kind, steps, compute_s, self._wait_s, pseudo_gradient, inner_state, buffers))
            if kind == _BYE:
                return
            next_steps, params = self._server.local_replies.get(timeout=self._server.timeout)
            self._server.raise_error()
            outer_updates = self._outer.outer_updates if self._outer is not None else 0
        else:
            push_group, reply_group = self._groups  # type: ignore[misc]
            dist.send(torch.tensor(header, dtype=torch.float64), dst=0, group=push_group)
            if payload is not None:
                dist.send(payload, dst=0, group=push_group)
            if inner_state is not None:
                dist.send(inner_state, dst=0, group=push_group)
            if kind == _BYE:
                return
            reply = torch.empty(_SERVER_HEADER, dtype=torch.float64)
            dist.recv(reply, src=0, group=reply_group)
            next_steps, outer_updates = int(reply[0]), int(reply[1])
            params = None
            if next_steps:
                params = self._pulled
                dist.recv(params[:n], src=0, group=reply_group)
                if params.numel() > n:
                    dist.recv(params[n:], src=0, group=reply_group)
        self._wait_s = time.perf_counter() - start
        self._steps_in_round = 0
        self._round_steps = int(next_steps)
        self.rounds.append((self._round_steps, int(outer_updates)))
        if next_steps == 0:
            self._stopped_by_server = True
            self.lightning_module.trainer.should_stop = True
            # the loop would otherwise run one more batch before it checks should_stop
            self._round_steps = math.inf  # type: ignore[assignment]
        else:
            assert params is not None
            if params is not self._pulled:
                self._pulled.copy_(params)
            self._write(self._model_state(), self._pulled)
        self._round_start = time.perf_counter()

    @property
    def outer_updates(self) -> int:
        """How many times the outer optimizer has stepped (rank 0; 0 elsewhere)."""
        return self._outer.outer_updates if self._outer is not None else 0

    def worker_stats(self) -> dict[int, dict[str, float]]:
        """Per-worker progress as the outer optimizer saw it (rank 0 only; empty elsewhere): inner ``steps``,
        completed ``rounds``, ``local_steps`` of the next round, ``steps_per_s``, ``staleness``."""
        if self._outer is None:
            return {}
        with self._outer.lock:
            keys = ("steps", "rounds", "local_steps", "steps_per_s", "staleness", "compute_s", "wait_s")
            return {w: {k: getattr(s, k) for k in keys} for w, s in sorted(self._outer.workers.items())}

    def _log_outer_metrics(self) -> None:
        if not self.is_global_zero or self._outer is None or self._outer.metrics_version == self._logged_version:
            return
        self._logged_version = self._outer.metrics_version
        trainer = self.lightning_module.trainer
        metrics = self._outer.metrics()
        self.report.add(trainer.global_step, metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self) -> None:
        """Leave the exchange (pushing any unfinished round), then give every rank the global model."""
        trainer = self.lightning_module.trainer
        if self._training_phase:
            if self.is_global_zero and trainer.should_stop and not self._stopped_by_server:
                assert self._outer is not None
                with self._outer.lock:
                    self._outer.stop_requested = True  # e.g. EarlyStopping on rank 0: stop every worker
            self._exchange(_BYE)
            if self._server is not None:
                self._server.join()
                self._log_outer_metrics()
                self._write_global_model()
            self._training_phase = False
            sync_module_states(self.lightning_module)
            max_steps, limit_val_batches = self._saved_limits  # type: ignore[misc]
            set_loop_max_steps(trainer, max_steps)
            trainer.limit_val_batches = limit_val_batches
            if not self.checkpoint_inner_states:  # else each worker's leaving message carried its final state
                self._gather_inner_states()
        super().on_train_end()

    def _gather_inner_states(self) -> None:
        states: list[Any] = [None] * self._workers
        local = move_data_to_device(self.optimizers[0].state_dict(), torch.device("cpu"))
        dist.all_gather_object(states, local, group=self._groups[0])  # type: ignore[index]
        self._inner_states = dict(enumerate(states))

    def on_exception(self, exception: BaseException) -> None:
        self._training_phase = False
        super().on_exception(exception)

    # ------------------------------------------------------------------ global model for validation / checkpoints
    def _write_global_model(self) -> None:
        """Rank 0: write the outer state's global parameters and floating-point buffers into the model."""
        assert self._outer is not None
        with self._outer.lock:
            self._write(self._params(), self._outer.params)
            self._write(self._buffers(), self._outer.buffers)

    @contextmanager
    def _global_params(self) -> Iterator[None]:
        """On rank 0 during training: temporarily swap in the current global parameters and buffers."""
        if not (self._training_phase and self._outer is not None):
            yield
            return
        saved = self._read(self._model_state(), self._host_buffer(self._local.numel()))
        self._write_global_model()
        try:
            yield
        finally:
            self._write(self._model_state(), saved)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._training_phase and self._outer is not None:
            self._validation_ctx = self._global_params()
            self._validation_ctx.__enter__()

    def on_validation_end(self) -> None:
        ctx = getattr(self, "_validation_ctx", None)
        if ctx is not None:
            self._validation_ctx = None
            ctx.__exit__(None, None, None)
        super().on_validation_end()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._global_params():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.is_global_zero and self._outer is not None:
            state = self._outer.state_dict()
            if not self.checkpoint_inner_states:  # only rank 0's own state is at hand while training
                state["inner_optimizer_states"] = self._inner_states or {0: self.optimizers[0].state_dict()}
            checkpoint = {**checkpoint, _CHECKPOINT_KEY: state}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = read_checkpoint(lambda: super(AsyncLocalSGDStrategy, self).load_checkpoint(
            checkpoint_path, weights_only=weights_only), checkpoint_path)
        self._resume_state = checkpoint.get(_CHECKPOINT_KEY)
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each worker resumes its own inner optimizer state when the checkpoint has it, else rank 0's."""
        inner = (checkpoint.get(_CHECKPOINT_KEY) or {}).get("inner_optimizer_states") or {}
        if self.global_rank in inner:
            self.optimizers[0].load_state_dict(inner[self.global_rank])
        else:
            super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ collectives: local while workers diverge
    @property
    def world_size(self) -> int:
        """1 while workers train independently, so that Lightning's loops issue no per-step collectives."""
        return 1 if self._training_phase else super().world_size

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._training_phase:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._training_phase else super().broadcast(obj, src)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        return tensor if self._training_phase else super().reduce(tensor, group, reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return tensor if self._training_phase else super().all_gather(tensor, group, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """During training only rank 0 decides; its stop decision reaches the workers via the exchange."""
        if self._training_phase:
            return bool(decision) and self.is_global_zero
        return super().reduce_boolean_decision(decision, all)

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register the async and DiLoCo names (subprocess and spawn launchers) without replacing existing ones."""
        register_names(strategy_registry, cls, [
            (name, f"{'Asynchronous Local-SGD' if mode == 'async' else 'DiLoCo'} with start_method '{method}'",
             {"mode": mode, "start_method": method})
            for name, method, mode in (("async_local_sgd", "popen", "async"), ("async_local_sgd_spawn", "spawn", "async"),
                                       ("diloco", "popen", "sync"), ("diloco_spawn", "spawn", "sync"))
        ])


class AsyncLogging(Callback):
    """What the async strategy shows: the outer-update count and the slowest worker in the progress bar, its
    settings in the run config (``async/...``), and at the end of fit the per-worker figures in W&B."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and isinstance(trainer.strategy, AsyncLocalSGDStrategy):
            record_config(trainer, "async", trainer.strategy.config)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        stats = strategy.worker_stats() if isinstance(strategy, AsyncLocalSGDStrategy) else {}
        if not stats:
            return
        slowest = min(stats, key=lambda w: stats[w]["steps_per_s"] or math.inf)
        pl_module.log("async/outer_updates", float(strategy.outer_updates), prog_bar=True, logger=False,
                      rank_zero_only=True)
        pl_module.log("async/slowest", float(slowest), prog_bar=True, logger=False, rank_zero_only=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if trainer.is_global_zero and isinstance(strategy, AsyncLocalSGDStrategy):
            log_report_figures(trainer, strategy.report)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        finish_worker_run(trainer)
