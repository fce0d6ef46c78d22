"""This process's part of the exchange during one ``fit``: its worker and, on rank 0, the outer state's server."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._tensors import float_buffers, host_buffer, model_state, numel, read_into, write_from
from lightning_hdet.asynchronous.exchange.overlapped import OverlapWorker
from lightning_hdet.asynchronous.exchange.ranks import FollowerTransport, LeaderTransport, WorkerRanks
from lightning_hdet.asynchronous.exchange.server import Server
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.exchange.worker_shards import ShardedWorker
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.lookahead import Score
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.wire.codecs import Codec, NoCodec
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind
from lightning_hdet.asynchronous.wire.network import Link, Transport, check_transport
from lightning_hdet.asynchronous.wire.transport import WorkerTransport


def read_model(module: Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    params, buffers = list(module.parameters()), float_buffers(module)
    return (read_into(params, host_buffer(numel(params), device), device),
            read_into(buffers, host_buffer(numel(buffers), device), device))


class GroupJob:
    """The collectives of a worker's ranks over ``group``, a process group of them all (its rank 0 broadcasts)."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self._src = dist.get_global_rank(group, 0)

    def broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=self._src, group=self.group)

    def max_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)


class Exchange:
    """Start the exchange (rank 0 also its ``outer`` state's server), run it, leave it. ``groups``: the strategy's
    two ``gloo`` groups (``()`` in one process); ``inner_optimizer`` is sent with every push; ``optimizer`` is
    cleared after a rejected push; ``worker_group``/``shard_group``: the worker's own groups; the others are the
    strategy's options."""

    def __init__(self, module: Module, device: torch.device, groups: tuple[Any, Any], workers: int, timeout: float,
                 inner_optimizer: Optimizer | None = None, outer: OuterState | None = None,
                 compression: Codec = NoCodec(), error_feedback: bool = True, pull_compression: Codec = NoCodec(),
                 optimizer: Optimizer | None = None, check_self: bool = True, ranks: WorkerRanks | None = None,
                 worker_group: Any = None, overlap_steps: int = 0, shard_group: Any = None,
                 outer_optimizer: OuterOptimizer | None = None, stagger: int = 1,
                 transport: Transport | None = None) -> None:
        self.module, self.device, self.outer, self.workers = module, device, outer, workers
        self.groups: tuple[Any, ...] = groups
        rule = outer_optimizer
        layout = Fragments([p.shape for p in module.parameters()], compression, pull_compression=pull_compression,
                           parts=stagger, forward=rule.forward(workers) if rule is not None else None)
        self.server: Server | None = None
        k = ranks.ranks_per_worker if ranks is not None else 1
        network = check_transport(transport)
        link = Link(layout, numel(float_buffers(module)), tuple(groups), k)
        end: WorkerTransport | None = None  # a follower's comes from its leader (below)
        if outer is not None:
            self.server = Server(outer, workers, network.server_end(link), timeout, layout)
            self.server.start()
            end = network.local_end(self.server.local, link)
        elif ranks is None or ranks.is_leader:
            end = network.worker_end(link, ranks.worker if ranks is not None else dist.get_rank())
        if ranks is not None and k > 1:
            end, inner_optimizer = self._within_worker(ranks, worker_group, end, inner_optimizer,
                                                       shard_group is not None)
        assert end is not None
        args = (module, device, end, inner_optimizer, layout, error_feedback, optimizer, check_self)
        if outer is not None and outer.step_policy.mode == "async":
            overlap_steps = 0
        self.worker: Worker
        decay = rule.feedback_decay() if rule is not None else None
        decay = 1.0 if decay is None else decay
        if shard_group is not None:
            self.worker = ShardedWorker(*args, group=shard_group, leader=ranks is None or ranks.is_leader,
                                        error_decay=decay)
        elif overlap_steps:
            self.worker = OverlapWorker(*args, overlap_steps=overlap_steps, error_decay=decay)
        else:
            self.worker = Worker(*args, error_decay=decay)

    @staticmethod
    def _within_worker(ranks: WorkerRanks, group: Any, transport: WorkerTransport | None,
                       inner_optimizer: Optimizer | None, sharded: bool) -> tuple[WorkerTransport, Optimizer | None]:
        """A worker of several ranks: the leader hands replies on over ``group``; the others send no inner state."""
        job = GroupJob(group, ranks.rank - ranks.leader, ranks.ranks_per_worker)  # the leader is its group's rank 0
        if ranks.is_leader:
            assert transport is not None
            return LeaderTransport(transport, job.broadcast, job.max_reduce), inner_optimizer
        return FollowerTransport(job.broadcast, job.max_reduce, gathers=sharded), None

    @staticmethod
    def start_outer(settings: OuterSettings, module: Module, device: torch.device, workers: int,
                    budget: int | None, resume: dict[str, Any] | None,
                    read: Callable[[Module, torch.device], tuple[torch.Tensor, torch.Tensor]] = read_model,
                    score: Score | None = None) -> OuterState:
        """Rank 0: the outer state, from this model (``read``) or the checkpoint's outer state ``resume``;
        ``score``: a lookahead's (:meth:`OuterSettings.build`)."""
        layout = Fragments([p.shape for p in module.parameters()], parts=settings.stagger)  # the same for every codec
        outer = settings.build(*read(module, device), workers, budget, layout.ranges, layout.parts, score)
        if resume is not None:
            outer.load_state_dict(resume, workers=workers)
        return outer

    def leave(self, stop_everyone: bool) -> None:
        """Push any unfinished round and leave; rank 0 waits for every worker and writes the global model."""
        if self.outer is not None and stop_everyone and not self.worker.stopped:
            self.outer.request_stop()
        self.worker.exchange(Kind.BYE)
        if self.server is not None:
            self.server.join()
            if not isinstance(self.worker, ShardedWorker):  # sharded: every rank writes it (share_global_model)
                self.write_global_model()

    def share_global_model(self, group: Any) -> None:
        """FSDP2 inside, after every rank left: rank 0 broadcasts the global model; each writes its shards."""
        flat, n = self.worker.pulled, self.worker.n_params
        if self.outer is not None:
            with self.outer.model_lock:
                flat[:n].copy_(self.outer.params)
                flat[n:].copy_(self.outer.buffers)
        dist.broadcast(flat, src=0, group=group)
        self.worker.write_pulled()

    def close(self) -> None:
        """End this exchange on every path before its groups go: stop rank 0's server threads, drop every
        reference to the groups (a receiver blocked in gloo returns once the peers close)."""
        if self.server is not None and self.server.running:
            self.server.stop(timeout=1.0)
        self.worker.transport.close()
        if self.server is not None and self.server.remote is not None:
            self.server.remote.close()
        self.groups = ()

    def write_global_model(self, snapshot: Mapping[str, Any] | None = None) -> None:
        """Rank 0: write the global model (the outer state's, or ``snapshot``'s) into the module."""
        assert self.outer is not None
        source = snapshot or {"params": self.outer.params, "buffers": self.outer.buffers}
        with self.outer.model_lock if snapshot is None else nullcontext():  # no host copy of the global model
            write_from(list(self.module.parameters()), source["params"], self.device)
            write_from(float_buffers(self.module), source["buffers"], self.device)

    @contextmanager
    def global_model(self, snapshot: Mapping[str, Any] | None = None) -> Iterator[None]:
        """Rank 0: the module holds the global model (or ``snapshot``'s) inside the block: swapped with the one
        its worker pulled where equal (DiLoCo), else its own waits in a host copy."""
        if snapshot is None and self._pulled_is_global():
            self.worker.swap_pulled()
            try:
                yield
            finally:
                self.worker.swap_pulled()
            return
        tensors = model_state(self.module)
        spare = self.worker.spare_buffer()
        saved = read_into(tensors, host_buffer(numel(tensors), self.device) if spare is None else spare, self.device)
        self.write_global_model(snapshot)
        try:
            yield
        finally:
            write_from(tensors, saved, self.device)

    def _pulled_is_global(self) -> bool:
        assert self.outer is not None
        pulled, n = self.worker.pulled, self.outer.params.numel()
        if self.worker.fragment.numel() == 0:  # no parameters: nothing to swap through
            return False
        with self.outer.model_lock:  # one version; a push applied after this is not in the validated model
            return torch.equal(pulled[:n], self.outer.params) and torch.equal(pulled[n:], self.outer.buffers)
