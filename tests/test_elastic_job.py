"""An elastic worker of several ranks (issue 42): the job's rank 0 meets the service and hands the session, every
reply and the global model on to the other ranks. In one process: the job's ranks are threads over an in-memory
:class:`~lightning_hdet.asynchronous.elastic.job.JobComm`; the multi-process run is in tests/test_elastic.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_hdet import ElasticDDPWorkerStrategy, ElasticWorkerStrategy
from lightning_hdet.asynchronous.elastic.job import (
    LOST,
    JobFollowerTransport,
    JobLeaderTransport,
    SoloJob,
    broadcast_json,
    job_transport,
    share_session,
)
from lightning_hdet.asynchronous.elastic.membership import SessionLost
from lightning_hdet.asynchronous.elastic.strategy import ElasticWorker
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.wire.messages import Kind, ServerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport
from tests.helpers import LinearModel


class _Shared:
    """What the threads of one job meet at (a barrier that fails instead of hanging)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list[Any] = [None] * size


class _ThreadJob:
    """One rank of a job whose ranks are threads of this process."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self.shared, self.rank, self.size = shared, rank, len(shared.slots)

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.shared.slots[0] = tensor.clone()
        self.shared.barrier.wait()
        if self.rank != 0:
            tensor.copy_(self.shared.slots[0])
        self.shared.barrier.wait()

    def max_reduce(self, tensor: torch.Tensor) -> None:
        self.shared.slots[self.rank] = tensor.clone()
        self.shared.barrier.wait()
        largest = torch.stack(self.shared.slots).amax(dim=0)
        self.shared.barrier.wait()
        tensor.copy_(largest)


def _ranks(size: int, *steps: Callable[[_ThreadJob], Any]) -> list[Any]:
    """Run ``steps[r](job_r)`` on one thread per rank; each rank's result, or the exception it raised."""
    shared, results = _Shared(size), [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = steps[rank](_ThreadJob(shared, rank))
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


class _Service(WorkerTransport):
    """Rank 0's session, in memory: scripted replies (a model each), optionally lost on push or pull."""

    def __init__(self, replies: list[tuple[ServerHeader, torch.Tensor | None]], lose: str | None = None) -> None:
        self.replies, self.lose, self.pushed = list(replies), lose, []

    def push(self, header, messages, buffers, inner_state):
        if self.lose == "push":
            raise SessionLost("session 1: push failed: peer closed")
        self.pushed.append((header, torch.cat([m.clone() for m in messages]) if header.steps else None))

    def pull(self, into):
        if self.lose == "pull":
            raise SessionLost("session 1: pull failed: peer closed")
        header, model = self.replies.pop(0)
        if header.next_local_steps > 0:  # a stop reply carries no model
            into.copy_(model)
        return header


def _worker(job: _ThreadJob, service: _Service | None) -> tuple[Worker, torch.optim.Optimizer]:
    module = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return Worker(module, torch.device("cpu"), job_transport(job, service), optimizer=optimizer), optimizer


def _train(worker: Worker, optimizer: torch.optim.Optimizer, steps: int) -> None:
    """The same steps on every rank (DDP's all-reduced gradients make them identical)."""
    for _ in range(steps):
        optimizer.zero_grad()
        worker.module(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        worker.step()


def test_every_rank_takes_the_same_rounds_rejections_and_stop_from_rank_zeros_replies() -> None:
    m1, m2 = torch.full((4,), 1.0), torch.full((4,), 2.0)
    service = _Service([(ServerHeader(4, 1), m1), (ServerHeader(3, 2, rejected=1), m2), (ServerHeader(0, 3), None)])

    def rank(job: _ThreadJob) -> dict[str, Any]:
        worker, optimizer = _worker(job, service if job.rank == 0 else None)
        seen = []
        worker.exchange(Kind.HELLO)
        seen.append(torch.cat([p.detach().flatten() for p in worker.module.parameters()]))
        _train(worker, optimizer, 4)
        worker.round_start -= 2.0 * job.rank  # rank 1 is the slower one: its compute time is the round's
        worker.exchange(Kind.PUSH)  # rejected: a fresh inner state, the global model
        seen.append(torch.cat([p.detach().flatten() for p in worker.module.parameters()]))
        state_after_rejection = len(optimizer.state)
        _train(worker, optimizer, 3)
        worker.exchange(Kind.PUSH)  # stop: no model follows
        final = torch.cat([p.detach().flatten() for p in worker.module.parameters()])
        return {"seen": seen, "rounds": worker.rounds, "stopped": worker.stopped, "final": final,
                "state_after_rejection": state_after_rejection, "rejected": worker.rejected}

    leader, follower = _ranks(2, rank, rank)
    assert not isinstance(leader, BaseException), leader
    assert not isinstance(follower, BaseException), follower
    assert torch.equal(leader["seen"][0], m1) and torch.equal(follower["seen"][0], m1)
    assert torch.equal(leader["seen"][1], m2) and torch.equal(follower["seen"][1], m2)
    assert leader["rounds"] == follower["rounds"] == [(4, 1), (3, 2), (0, 3)]
    assert leader["stopped"] and follower["stopped"] and torch.equal(leader["final"], follower["final"])
    assert leader["state_after_rejection"] == follower["state_after_rejection"] == 0
    assert leader["rejected"] == follower["rejected"] == 0  # the last reply accepted the push
    kinds = [(h.kind, h.steps) for h, _ in service.pushed]
    assert kinds == [(Kind.HELLO, 0), (Kind.PUSH, 4), (Kind.PUSH, 3)]  # one push per round, from rank 0 only
    assert service.pushed[1][0].compute_s >= 2.0  # the job's slowest rank


@pytest.mark.parametrize("lose", ["push", "pull"])
def test_a_session_lost_on_rank_zero_is_lost_on_every_rank(lose: str) -> None:
    def rank(job: _ThreadJob) -> Any:
        worker, _ = _worker(job, _Service([], lose=lose) if job.rank == 0 else None)
        worker.steps_in_round = 2
        worker.exchange(Kind.PUSH)

    results = _ranks(3, rank, rank, rank)
    assert all(isinstance(r, SessionLost) for r in results), results
    assert "rank 0 lost the session" in str(results[2])


def test_leaving_with_a_lost_session_does_not_wait_for_a_reply() -> None:
    def rank(job: _ThreadJob) -> Any:
        worker, _ = _worker(job, _Service([], lose="push") if job.rank == 0 else None)
        worker.exchange(Kind.BYE)
        return "left"

    leader, follower = _ranks(2, rank, rank)
    assert isinstance(leader, SessionLost) and follower == "left"


def test_rank_zero_shares_its_session_or_why_it_has_none() -> None:
    config = {"n_params": 9, "n_buffers": 0, "compression": "none"}

    def opened() -> tuple[int, dict]:
        return 7, config

    def refused() -> tuple[int, dict]:
        raise PermissionError("the token does not match")

    def unreachable() -> tuple[int, dict]:
        raise SessionLost("cannot register")

    def never() -> tuple[int, dict]:
        pytest.fail("only rank 0 opens a session")

    ok = _ranks(2, lambda job: share_session(job, opened), lambda job: share_session(job, never))
    assert ok == [(7, config), (7, config)]
    leader, follower = _ranks(2, lambda job: share_session(job, refused), lambda job: share_session(job, never))
    assert type(leader) is PermissionError and type(follower) is PermissionError
    assert "rank 0 of this worker job could not open a session: the token does not match" in str(follower)
    leader, follower = _ranks(2, lambda job: share_session(job, unreachable), lambda job: share_session(job, never))
    assert type(leader) is SessionLost and type(follower) is RuntimeError
    assert share_session(SoloJob(), opened) == (7, config)


def test_broadcast_json_and_the_transports_of_a_job() -> None:
    value = {"a": [1, 2.5, "é"], "b": None}
    assert _ranks(2, lambda job: broadcast_json(job, value), lambda job: broadcast_json(job)) == [value, value]
    service = _Service([])
    assert job_transport(SoloJob(), service) is service  # one rank: exactly the one-process worker
    leader, follower = _ranks(2, lambda job: job_transport(job, service), lambda job: job_transport(job, None))
    assert isinstance(leader, JobLeaderTransport) and isinstance(follower, JobFollowerTransport)
    assert LOST.next_local_steps < 0  # never a real reply


class _Hooks:
    """The Lightning hooks ElasticWorker extends, as no-ops."""

    def on_train_start(self) -> None:
        pass


class _Client:
    """Rank 0's sessions, in memory: session ``s`` talks to ``services[s - 1]``."""

    def __init__(self, services: list[_Service]) -> None:
        self.services, self.session = services, 0
        self.config = {"n_params": 4, "n_buffers": 0, "compression": "none", "pull_compression": "none"}

    def reopen(self) -> tuple[int, dict[str, Any]]:
        self.session += 1
        return self.session, self.config

    def transport(self, layout: Any) -> _Service:
        return self.services[self.session - 1]

    def close(self) -> None:
        pass


class _Rank(ElasticWorker, _Hooks):
    """ElasticWorker's own logic on one rank of a job, without Lightning."""

    def __init__(self, job: _ThreadJob, client: _Client | None) -> None:
        self._elastic_init("127.0.0.1:1", 10, 0.0, 1.0, 10.0, True, None)
        self._job, self._client, self._fitting = job, client, True
        self.lightning_module = torch.nn.Linear(3, 1)
        self.lightning_module.trainer = type("Trainer", (), {"should_stop": False})()
        self.optimizers = [torch.optim.SGD(self.lightning_module.parameters(), lr=0.1)]
        self.root_device = torch.device("cpu")


def test_a_lost_session_is_reopened_by_rank_zero_and_every_rank_continues_from_the_newest_model() -> None:
    m1, m2 = torch.full((4,), 1.0), torch.full((4,), 2.0)
    first = _Service([(ServerHeader(2, 1), m1)])
    second = _Service([(ServerHeader(3, 5), m2)])
    client = _Client([first, second])

    def rank(job: _ThreadJob) -> dict[str, Any]:
        worker = _Rank(job, client if job.rank == 0 else None)
        worker._open()  # session 1, shared
        worker.on_train_start()  # HELLO: m1, a round of 2
        worker._worker.step(), worker._worker.step()
        first.lose = "pull"
        worker._exchange(Kind.PUSH)  # lost: rank 0 reopens (session 2), every rank says hello again
        params = torch.cat([p.detach().flatten() for p in worker.lightning_module.parameters()])
        return {"sessions": worker.sessions, "params": params, "rounds": worker.rounds,
                "steps_in_round": worker._worker.steps_in_round, "seed": torch.initial_seed()}

    results = _ranks(2, rank, rank)
    assert not any(isinstance(r, BaseException) for r in results), results
    for r in results:
        assert r["sessions"] == [1, 2] and torch.equal(r["params"], m2) and r["steps_in_round"] == 0
        assert r["rounds"] == [(2, 1), (3, 5)] and r["seed"] == 12  # seed + session
    assert [h.kind for h, _ in second.pushed] == [Kind.HELLO]  # the unfinished round died with session 1


def test_ddp_worker_checks_its_arguments_and_seeds_the_sampler_with_its_session() -> None:
    with pytest.raises(ValueError, match="`server`"):
        ElasticDDPWorkerStrategy("no-port")
    with pytest.raises(ValueError, match="`timeout_s`"):
        ElasticDDPWorkerStrategy("127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="`seed`"):
        ElasticDDPWorkerStrategy("127.0.0.1:1", seed=-1)
    strategy = ElasticDDPWorkerStrategy("127.0.0.1:1", seed=5, find_unused_parameters=True)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert trainer.strategy is strategy and strategy.num_processes == 2 and strategy.sessions == []
    assert "seed" not in strategy.distributed_sampler_kwargs
    strategy._sessions = [3]  # as after opening session 3
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0, "seed": 8}


def test_a_one_device_worker_given_several_devices_warns_and_fails_fast_without_a_service() -> None:
    strategy = ElasticWorkerStrategy("127.0.0.1:1", reconnect_s=0)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, max_epochs=-1)
    with pytest.warns(UserWarning, match="ElasticDDPWorkerStrategy"), \
            pytest.raises(RuntimeError, match="No outer service reachable"):
        trainer.fit(LinearModel())
    assert strategy.sessions == []
