"""An elastic worker of several ranks: one Lightning DDP job (e.g. a node's k devices) that is ONE session.

Inside the job it is plain DDP (gradients all-reduced over the job's ranks every inner step, one identical inner
optimizer state per rank, Lightning's distributed sampler sharding the data over the job's ranks); towards the
service it is one worker: the job's rank 0 opens the session, heartbeats, pushes and pulls, and hands every reply
and global model on to the other ranks over a ``gloo`` group of the job (:mod:`.job`). No group spans two jobs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_hdet._checks import check_names, own_arguments
from lightning_hdet._compat import DDP_OPTIONS
from lightning_hdet._process_groups import destroy_default_group_at_exit, destroy_groups
from lightning_hdet.asynchronous.elastic.job import JobComm, SoloJob
from lightning_hdet.asynchronous.elastic.sessions import session_seed
from lightning_hdet.asynchronous.elastic.strategy import ElasticWorker
from lightning_hdet.asynchronous.exchange.exchange import GroupJob


class ElasticDDPWorkerStrategy(ElasticWorker, DDPStrategy):
    """One worker of an :class:`~.service.OuterService` made of several ranks training as DDP, e.g.
    ``Trainer(strategy=ElasticDDPWorkerStrategy(server), devices=8)`` on one node, or under ``torchrun``.

    The job is one session: its rank 0 alone meets the service and broadcasts each reply (the next round's length,
    a stop, a rejection) and the pulled global model to the job's other ranks, so every rank keeps identical
    parameters and stops at the same step. The service counts the job's steps like a one-device worker's: a round
    of ``H`` steps is ``H`` inner steps of its budget, each step reading one batch per rank (as a worker of
    ``ranks_per_worker`` ranks counts for :class:`~lightning_hdet.AsyncLocalSGDStrategy`). Lightning's sampler
    shards the data over the job's ranks, its shuffle seeded with ``seed + session``.

    Args:
        server: the service's ``"host:port"``.
        seed: session ``s`` seeds the data order with ``seed + s`` (the distributed sampler's shuffle and torch's
            global generator, the same on every rank of the job).
        reconnect_s: seconds rank 0 keeps trying to reopen a session after losing the service (every rank then
            continues from the newest global model); 0: fail at once.
        heartbeat_s: seconds between rank 0's heartbeats (keep well below the service's ``lease_s``).
        timeout_s: seconds any message may take; longer than a round (a parked worker waits for its reply).
        error_feedback: with a compressing service, keep what the codec lost and add it to the next push.
        token: the shared secret of a service started with one (``OuterService(token=...)``).
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``timeout``,
            ``find_unused_parameters``, ...), for the DDP inside the job.
    """

    def __init__(self, server: str, seed: int = 0, reconnect_s: float = 60.0, heartbeat_s: float = 1.0,
                 timeout_s: float = 1800.0, error_feedback: bool = True, token: str | None = None,
                 **kwargs: Any) -> None:
        check_names(type(self).__name__, kwargs, own_arguments(type(self)),
                    {"Lightning DDPStrategy": own_arguments(DDPStrategy), "DistributedDataParallel": DDP_OPTIONS})
        self._elastic_init(server, seed, reconnect_s, heartbeat_s, timeout_s, error_feedback, token)
        super().__init__(**kwargs)
        self._job_group: Any = None

    def _job_for_fit(self) -> JobComm:
        """A ``gloo`` group of the job's ranks: the replies and the global model are host tensors (the DDP group may
        be NCCL). Its timeout covers rank 0's longest exchange, reconnecting included: the others wait meanwhile."""
        if self.world_size == 1:
            return SoloJob()
        timeout = timedelta(seconds=2 * self.timeout_s + self.reconnect_s)
        self._job_group = dist.new_group(backend="gloo", timeout=timeout)
        destroy_default_group_at_exit()
        return GroupJob(self._job_group, self.global_rank, self.world_size)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """DDP's, with the shuffle seeded by the session open when the data loaders are made (``seed + session``)."""
        kwargs = super().distributed_sampler_kwargs
        return {**kwargs, "seed": session_seed(self.seed, self._sessions[-1])} if self._sessions else kwargs

    @override
    def teardown(self) -> None:
        """Release the job's group on every path (no reference may keep a destroyed group's threads alive)."""
        if self._worker is not None:
            self._worker.transport.close()
        self._job = SoloJob()
        group, self._job_group = self._job_group, None
        destroy_groups([group])
        super().teardown()
