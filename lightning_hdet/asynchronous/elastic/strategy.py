"""A worker of an elastic run as an ordinary Lightning job (``docs/elastic.md``).

No process group spans the workers: each one is its own ``Trainer``, so Lightning's launcher, its child observer
and its collectives never couple them. The strategy opens a session with the outer service
(:class:`~.service.OuterService`), starts from the newest global model, and runs the same rounds as the
single-job mode through the unchanged :class:`~..worker.Worker`; the session's transport is the only new piece.
:class:`ElasticWorker` holds the hooks; :class:`ElasticWorkerStrategy` runs them on one device, and
:class:`~.ddp.ElasticDDPWorkerStrategy` on a job of several ranks training as DDP (:mod:`.job`).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_bool, check_int, check_names, check_number, own_arguments
from lightning_hdet._compat import requested_devices
from lightning_hdet._tensors import float_buffers, numel
from lightning_hdet.asynchronous.elastic.client import SessionClient
from lightning_hdet.asynchronous.elastic.job import JobComm, SoloJob, job_transport, share_session
from lightning_hdet.asynchronous.elastic.membership import SessionLost, parse_address
from lightning_hdet.asynchronous.elastic.sessions import check_token, session_seed
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.lightning.limits import LoopLimits
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind
from lightning_hdet.asynchronous.wire.transport import WorkerTransport

log = logging.getLogger(__name__)


class ElasticWorker:
    """The elastic worker's Lightning hooks, for a Lightning strategy to mix in first. The job's rank 0 meets the
    service; every rank runs the same :class:`~..worker.Worker` bookkeeping from the replies it hands on."""

    lightning_module: pl.LightningModule
    optimizers: list[Optimizer]
    root_device: torch.device

    def _elastic_init(self, server: str, seed: int, reconnect_s: float, heartbeat_s: float, timeout_s: float,
                      error_feedback: bool, token: str | None) -> None:
        """Check and keep the arguments (see :class:`ElasticWorkerStrategy`), before Lightning's ``__init__``."""
        parse_address(server)
        check_token(token)
        check_int("seed", seed, minimum=0)
        check_number("reconnect_s", reconnect_s, low=0, hint="It is in seconds; 0 fails at once.")
        for name, value in (("heartbeat_s", heartbeat_s), ("timeout_s", timeout_s)):
            check_number(name, value, low=0, low_open=True, hint="It is in seconds.")
        check_bool("error_feedback", error_feedback)
        self.server, self.seed, self.reconnect_s = server, seed, reconnect_s
        self.heartbeat_s, self.timeout_s, self.error_feedback, self.token = heartbeat_s, timeout_s, error_feedback, token
        self._client: SessionClient | None = None  # the job's rank 0 only
        self._job: JobComm = SoloJob()
        self._worker: Worker | None = None
        self._sessions: list[int] = []
        self._config: dict[str, Any] = {}
        self._fitting = False
        self._limits = LoopLimits()

    @property
    def sessions(self) -> list[int]:
        """Every session this worker opened (more than one after reconnecting); the same on every rank of a job."""
        return list(self._sessions)

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps this worker took in the current (or last) ``fit``."""
        return self._worker.inner_steps if self._worker is not None else 0

    @property
    def rounds(self) -> list[tuple[int, int]]:
        """One entry per exchange: ``(local_steps_assigned, outer_updates_seen)``."""
        return self._worker.rounds if self._worker is not None else []

    def _job_for_fit(self) -> JobComm:
        """The collectives over this worker job's ranks (one rank: none)."""
        return SoloJob()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one (inner) optimizer, got {len(self.optimizers)}.")
        # The service's budget stops this worker (trainer.should_stop); only the service validates.
        self._limits.lift(trainer)
        trainer.limit_val_batches = 0
        self._job, self._sessions, self._fitting = self._job_for_fit(), [], True
        if self._job.rank == 0:
            self._client = SessionClient(self.server, self.reconnect_s, self.heartbeat_s, self.timeout_s, self.token)
        self._open()  # before the data loaders exist, so that the session's seed orders the data

    def _open_session(self) -> tuple[int, dict[str, Any]]:
        """Rank 0: (re)open a session with the service; its id and the service's config."""
        assert self._client is not None
        return self._client.reopen()

    def _open(self) -> None:
        """Open a session (rank 0) and take it on every rank: check the model, seed the data, new transport."""
        session, self._config = share_session(self._job, self._open_session)
        self._sessions.append(session)
        config, module = self._config, self.lightning_module
        mine = (numel(list(module.parameters())), numel(float_buffers(module)))
        if mine != (config["n_params"], config["n_buffers"]):
            if self._client is not None:
                self._client.close()
            raise ValueError(f"This worker's model has {mine[0]} parameters and {mine[1]} floating-point buffer values,"
                             f" the outer service's {config['n_params']} and {config['n_buffers']}: every worker must"
                             " train the service's model.")
        torch.manual_seed(session_seed(self.seed, session))
        if self._worker is not None:
            self._worker.transport = self._transport(self._worker.layout)
            self._worker.steps_in_round = 0  # the unfinished round is lost with its session

    def _transport(self, layout: Fragments) -> WorkerTransport:
        session = self._client.transport(layout) if self._client is not None else None
        return job_transport(self._job, session)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if not self._fitting:
            return
        module, config = self.lightning_module, self._config
        layout = Fragments([p.shape for p in module.parameters()], config["compression"],
                           pull_compression=config["pull_compression"])
        self._worker = Worker(module, self.root_device, self._transport(layout), None, layout,
                              self.error_feedback, self.optimizers[0])
        rank = f" (rank {self._job.rank} of {self._job.size})" if self._job.size > 1 else ""
        self._worker.name = f"session {self._sessions[-1]}{rank}"
        self._exchange(Kind.HELLO)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._worker is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        with self._worker.inner_lr(optimizer):  # cut after rejected pushes in a row
            output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if not self._worker.stopped and self._worker.step():
            self._exchange(Kind.PUSH)
        return output

    def _exchange(self, kind: Kind) -> None:
        """One exchange; a lost session is reopened (with back-off) and the worker starts again from the newest
        global model. A reply without steps stops the training loop."""
        assert self._worker is not None
        while True:
            try:
                self._worker.exchange(kind)
                break
            except SessionLost as err:
                if kind == Kind.BYE:
                    return  # leaving anyway; the service ends the session when its group fails
                log.warning("%s; reopening a session", err)
                self._open()
                kind = Kind.HELLO
        if self._worker.stopped:
            self.lightning_module.trainer.should_stop = True

    @override
    def on_train_end(self) -> None:
        """Leave the session (the service counts nothing of an unfinished round: it is not pushed)."""
        if self._worker is not None and self._fitting:
            self._exchange(Kind.BYE)  # carries an unfinished round, as in the single-job mode
        self._close()
        super().on_train_end()  # type: ignore[misc]

    def _close(self) -> None:
        self._fitting = False
        if self._client is not None:
            self._client.close()
        self._limits.restore(self.lightning_module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close()
        super().on_exception(exception)  # type: ignore[misc]


class ElasticWorkerStrategy(ElasticWorker, SingleDeviceStrategy):
    """One worker of asynchronous Local-SGD served by an :class:`~.service.OuterService`, on one device
    (for a worker of several devices training as DDP, see :class:`~.ddp.ElasticDDPWorkerStrategy`).

    ``Trainer(max_steps=...)`` is ignored: the service's budget decides when every worker stops. The worker does
    not validate (the service does, with the global model); give it ``enable_checkpointing=False`` and let the
    service checkpoint.

    Args:
        server: the service's ``"host:port"``.
        device: this worker's device (default: the current CUDA device if there is one, else the CPU).
        seed: session ``s`` seeds torch's global generator with ``seed + s`` when it opens, so every session
            draws its own data order (a default shuffling ``DataLoader`` reads it).
        reconnect_s: seconds a worker keeps trying to reopen a session after losing the service (it then
            continues from the newest global model, dropping its unfinished round); 0: fail at once.
        heartbeat_s: seconds between heartbeats (keep well below the service's ``lease_s``).
        timeout_s: seconds any message may take; longer than a round (a parked worker waits for its reply).
        error_feedback: with a compressing service, keep what the codec lost and add it to the next push.
        token: the shared secret of a service started with one (``OuterService(token=...)``); a wrong one is
            refused with a :class:`PermissionError`. It keeps stray processes out; it is not encryption.
    """

    def __init__(self, server: str, device: Any = None, seed: int = 0, reconnect_s: float = 60.0,
                 heartbeat_s: float = 1.0, timeout_s: float = 1800.0, error_feedback: bool = True,
                 token: str | None = None, **kwargs: Any) -> None:
        check_names(type(self).__name__, kwargs, own_arguments(type(self)),
                    {"Lightning SingleDeviceStrategy": own_arguments(SingleDeviceStrategy)[1:]})  # (not `device`)
        self._elastic_init(server, seed, reconnect_s, heartbeat_s, timeout_s, error_feedback, token)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        devices = requested_devices(trainer)
        if trainer.state.fn == TrainerFn.FITTING and devices > 1:  # Lightning would silently train on the first
            rank_zero_warn(f"{type(self).__name__} trains on one device, got devices={devices}: for a worker of"
                           f" {devices} devices training as DDP, use ElasticDDPWorkerStrategy.")
        super().setup(trainer)
