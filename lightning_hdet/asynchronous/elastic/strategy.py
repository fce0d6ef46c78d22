"""A worker of an elastic run as an ordinary one-device Lightning job (``docs/elastic.md``).

No process group spans the workers: each one is its own ``Trainer(devices=1)``, so Lightning's launcher, its
child observer and its collectives never couple them. The strategy opens a session with the outer service
(:class:`~.service.OuterService`), starts from the newest global model, and runs the same rounds as the
single-job mode through the unchanged :class:`~..worker.Worker`; the session's transport is the only new piece.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_bool, check_int, check_number
from lightning_hdet._tensors import float_buffers, numel
from lightning_hdet.asynchronous.elastic.client import SessionClient
from lightning_hdet.asynchronous.elastic.membership import SessionLost, parse_address
from lightning_hdet.asynchronous.elastic.sessions import check_token
from lightning_hdet.asynchronous.elastic.sessions import session_seed
from lightning_hdet.asynchronous.limits import LoopLimits
from lightning_hdet.asynchronous.messages import Fragments, Kind
from lightning_hdet.asynchronous.worker import Worker

log = logging.getLogger(__name__)


class ElasticWorkerStrategy(SingleDeviceStrategy):
    """One worker of asynchronous Local-SGD (or DiLoCo) served by an :class:`~.service.OuterService`.

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
        parse_address(server)
        check_token(token)
        check_int("seed", seed, minimum=0)
        check_number("reconnect_s", reconnect_s, low=0, hint="It is in seconds; 0 fails at once.")
        for name, value in (("heartbeat_s", heartbeat_s), ("timeout_s", timeout_s)):
            check_number(name, value, low=0, low_open=True, hint="It is in seconds.")
        check_bool("error_feedback", error_feedback)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        super().__init__(device=device, **kwargs)
        self.server, self.seed, self.reconnect_s = server, seed, reconnect_s
        self.heartbeat_s, self.timeout_s, self.error_feedback, self.token = heartbeat_s, timeout_s, error_feedback, token
        self._client: SessionClient | None = None
        self._worker: Worker | None = None
        self._limits = LoopLimits()

    @property
    def sessions(self) -> list[int]:
        """Every session this worker opened (more than one after reconnecting)."""
        return list(self._client.sessions) if self._client is not None else []

    @property
    def inner_steps(self) -> int:
        """Inner optimizer steps this worker took in the current (or last) ``fit``."""
        return self._worker.inner_steps if self._worker is not None else 0

    @property
    def rounds(self) -> list[tuple[int, int]]:
        """One entry per exchange: ``(local_steps_assigned, outer_updates_seen)``."""
        return self._worker.rounds if self._worker is not None else []

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one (inner) optimizer, got {len(self.optimizers)}.")
        # The service's budget stops this worker (trainer.should_stop); only the service validates.
        self._limits.lift(trainer)
        trainer.limit_val_batches = 0
        self._client = SessionClient(self.server, self.reconnect_s, self.heartbeat_s, self.timeout_s, self.token)
        self._open()  # before the data loaders exist, so that the session's seed orders the data

    def _open(self) -> None:
        assert self._client is not None
        session = self._client.reopen()
        config = self._client.config
        module = self.lightning_module
        mine = (numel(list(module.parameters())), numel(float_buffers(module)))
        if mine != (config["n_params"], config["n_buffers"]):
            self._client.close()
            raise ValueError(
                f"This worker's model has {mine[0]} parameters and {mine[1]} floating-point buffer values, the outer"
                f" service's {config['n_params']} and {config['n_buffers']}: every worker must train the service's model."
            )
        torch.manual_seed(session_seed(self.seed, session))
        if self._worker is not None:
            self._worker.transport = self._client.transport(self._worker.layout)
            self._worker.steps_in_round = 0  # the unfinished round is lost with its session

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._client is None:
            return
        module = self.lightning_module
        config = self._client.config
        layout = Fragments([p.shape for p in module.parameters()], config["compression"],
                           pull_compression=config["pull_compression"])
        self._worker = Worker(module, self.root_device, self._client.transport(layout), None, layout,
                              self.error_feedback, self.optimizers[0])
        self._worker.name = f"session {self._client.session}"
        self._exchange(Kind.HELLO)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._worker is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with self._worker.inner_lr(optimizer):  # cut after rejected pushes in a row
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
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
        if self._worker is not None and self._client is not None:
            self._exchange(Kind.BYE)  # carries an unfinished round, as in the single-job mode
        self._close()
        super().on_train_end()

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._limits.restore(self.lightning_module)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close()
        super().on_exception(exception)
