"""Rank 0's checkpoint requests as a worker follows them, in one process against a real key-value store: a worker
keeps its state as of the exchanges a request's snapshot holds when it hears of it, and writes or removes its files
once rank 0 says what became of the request (a validation's snapshot: when the validation ends), never waiting."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_hdet.asynchronous.lightning.checkpoints import CheckpointRequests, WorkerCheckpoints, worker_file


class Worker1(WorkerCheckpoints):
    """Worker 1's leader with a one-number state (its step), outside any process group."""

    is_global_zero = False
    inside_worker = "ddp"
    checkpoint_io = TorchCheckpointIO()
    worker_ranks = SimpleNamespace(worker=1, is_leader=True, leader=1, describe=lambda: "worker 1")

    def __init__(self) -> None:
        self.step = 0
        self._exchange = SimpleNamespace(worker=SimpleNamespace(exchanges=0, checkpoints=0), outer=None)

    def _own_state(self) -> dict[str, Any]:
        return {"optimizer": {"step": torch.tensor(self.step)}}

    def exchange(self, heard: int) -> None:
        """One exchange after a step; its reply says rank 0 numbered ``heard`` requests so far."""
        self.step += 1
        self._exchange.worker.exchanges += 1
        self._exchange.worker.checkpoints = heard
        self.after_exchange()


def _store() -> Any:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=2))  # a read of something never posted fails instead of hanging the test
    return store


def _saved_step(path: Path) -> int:
    return int(torch.load(worker_file(path, 1), weights_only=True)["optimizer"]["step"])


def test_a_worker_keeps_its_state_for_an_undecided_request_and_writes_it_when_rank_0_decides(tmp_path: Path) -> None:
    store, path = _store(), tmp_path / "best.ckpt"
    worker, rank0 = Worker1(), CheckpointRequests(store, fit=1)
    worker.follow_checkpoints(store, keep=True)
    worker.exchange(0)
    worker.exchange(0)  # exchange 2, after step 2
    rank0.reserve(1, {0: 5, 1: 2})  # a validation starts: its snapshot holds worker 1's exchange 2
    worker.exchange(1)  # hears of it: rank 0 is still validating
    worker.exchange(1)
    assert list(tmp_path.iterdir()) == []  # undecided: nothing written yet, and nothing waited
    rank0.post(1, "save", [path])  # the validation ended, its checkpoint written
    worker.exchange(1)
    assert _saved_step(path) == 2  # the state as of exchange 2, not steps 3-5
    rank0.reserve(2, None)
    rank0.post(2, "remove", [path])
    worker.exchange(2)
    assert list(tmp_path.iterdir()) == []


def test_a_removal_never_overtakes_the_undecided_save_before_it(tmp_path: Path) -> None:
    store, path = _store(), tmp_path / "last.ckpt"
    worker, rank0 = Worker1(), CheckpointRequests(store, fit=1)
    worker.follow_checkpoints(store, keep=True)
    worker.exchange(0)
    rank0.reserve(1, {0: 1, 1: 1})
    rank0.reserve(2, None)
    rank0.post(2, "remove", [path])  # decided before request 1: waits for it
    worker.exchange(2)  # exchange 2
    assert list(tmp_path.iterdir()) == []
    rank0.post(1, "save", [path])
    worker.exchange(2)
    assert list(tmp_path.iterdir()) == []  # written (as of exchange 1), then removed, in that order
    rank0.reserve(3, {0: 2, 1: 3})
    rank0.post(3, "save", [path, tmp_path / "other.ckpt"])
    worker.exchange(3)  # exchange 4: request 3 holds its exchange 3, the one before
    assert _saved_step(path) == 3 and _saved_step(tmp_path / "other.ckpt") == 3


def test_a_worker_that_no_longer_holds_the_state_says_so_in_its_file(tmp_path: Path) -> None:
    store, path = _store(), tmp_path / "mine.ckpt"
    worker, rank0 = Worker1(), CheckpointRequests(store, fit=1)
    worker.follow_checkpoints(store, keep=False)  # no checkpoint callback: nothing kept between exchanges
    worker.exchange(0)
    worker.exchange(0)
    rank0.reserve(1, {0: 2, 1: 1})
    rank0.post(1, "save", [path])
    worker.exchange(1)  # exchange 3: exchange 1's state is gone
    own = torch.load(worker_file(path, 1), weights_only=True)
    assert list(own) == ["missing"] and "exchange 1" in own["missing"] and "no checkpoint callback" in own["missing"]
