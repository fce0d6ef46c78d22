"""The exchange without processes: the wire format, and workers + the server in one process over an in-memory
transport (as torchft tests LocalSGD with a mocked manager). Values are computed by hand in the comments."""

from __future__ import annotations

import queue
import threading
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_hdet.asynchronous.messages import Kind, Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.outer import AsyncStep, OuterSettings, OuterState
from lightning_hdet.asynchronous.server import Server
from lightning_hdet.asynchronous.transport import GlooWorkerTransport, InProcessTransport, ServerTransport
from lightning_hdet.asynchronous.worker import Worker

CPU = torch.device("cpu")


class QueueNetwork(ServerTransport):
    """The server's end for "remote" workers that live in this process: each has an :class:`InProcessTransport`."""

    def __init__(self, n_params: int, workers: list[int]) -> None:
        self.pushes: queue.Queue[Push] = queue.Queue()
        self.ends = {w: InProcessTransport(self.pushes, n_params, 60, lambda: None, worker=w) for w in workers}

    def receive(self) -> Push:
        return self.pushes.get(timeout=60)

    def reply(self, worker: int, header: ServerHeader, params: torch.Tensor, buffers: torch.Tensor) -> None:
        self.ends[worker].reply(header, params, buffers)


class Tiny(nn.Module):
    """Two parameters and one floating-point buffer (plus an integer one, which is never exchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("stat", torch.zeros(1))
        self.register_buffer("count", torch.zeros(1, dtype=torch.long))

    def set(self, w: list[float], stat: float) -> None:
        """What a round of local steps would leave behind."""
        with torch.no_grad():
            self.w.copy_(torch.tensor(w))
            self.stat.fill_(stat)


def _start(settings: OuterSettings, budget: int | None) -> tuple[Server, QueueNetwork, list[Tiny]]:
    modules = [Tiny(), Tiny()]
    outer = settings.build(torch.zeros(2), torch.zeros(1), workers=2, budget=budget)
    network = QueueNetwork(n_params=2, workers=[1])
    server = Server(outer, workers=2, remote=network, timeout=60)
    server.start()
    return server, network, modules


def _round(worker: Worker, module: Tiny, w: list[float], stat: float, steps: int) -> None:
    module.set(w, stat)
    assert [worker.step() for _ in range(steps)][-1]  # the round is complete after `steps` steps
    worker.exchange(Kind.PUSH)


# --------------------------------------------------------------------------------------------- the wire format
def test_kinds_are_the_documented_numbers() -> None:
    assert [int(k) for k in (Kind.HELLO, Kind.PUSH, Kind.BYE)] == [0, 1, 2]


def test_worker_header_round_trip() -> None:
    header = WorkerHeader(Kind.PUSH, steps=37, compute_s=1.25, wait_s=0.5, inner_state_bytes=2**40 + 3)
    raw = header.encode()
    assert raw.dtype == torch.float64 and raw.tolist() == [1.0, 37.0, 1.25, 0.5, float(2**40 + 3)]
    assert WorkerHeader.decode(raw) == header
    assert WorkerHeader.decode(WorkerHeader(Kind.BYE, 0, 0.0, 0.0).encode()).kind is Kind.BYE


def test_server_header_round_trip_and_bad_sizes() -> None:
    header = ServerHeader(next_local_steps=12, outer_updates=345)
    assert header.encode().tolist() == [12.0, 345.0]
    assert ServerHeader.decode(header.encode()) == header
    with pytest.raises(ValueError, match=r"server header is float64\[2\], got torch.float64\[5\]"):
        ServerHeader.decode(torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="worker header"):
        WorkerHeader.decode(torch.zeros(5, dtype=torch.float32))


def test_received_push_splits_the_payload() -> None:
    payload = torch.tensor([1.0, 2.0, 3.0, 9.0])
    push = Push.received(3, WorkerHeader(Kind.PUSH, 4, 2.0, 0.1), payload, n_params=3)
    assert (push.worker, push.kind, push.steps, push.compute_s, push.wait_s) == (3, Kind.PUSH, 4, 2.0, 0.1)
    assert push.pseudo_gradient.tolist() == [1.0, 2.0, 3.0] and push.buffers.tolist() == [9.0]
    payload[3] = 0.0  # the buffers are the server's own copy
    assert push.buffers.tolist() == [9.0]
    hello = Push.received(1, WorkerHeader(Kind.HELLO, 0, 0.0, 0.0), None, n_params=3)
    assert hello.pseudo_gradient is None and hello.buffers is None


def test_gloo_worker_sends_header_payload_inner_state_in_order() -> None:
    with mock.patch("torch.distributed.send") as send:
        GlooWorkerTransport("pushes", "replies", n_params=2).push(
            WorkerHeader(Kind.PUSH, 2, 1.0, 0.0, 5), torch.ones(3), torch.zeros(5, dtype=torch.uint8))
    sent = [(c.args[0].dtype, c.args[0].numel(), c.kwargs["dst"], c.kwargs["group"]) for c in send.call_args_list]
    assert sent == [(torch.float64, 5, 0, "pushes"), (torch.float32, 3, 0, "pushes"), (torch.uint8, 5, 0, "pushes")]


# ------------------------------------------------------------------------- workers and the server, one process
def test_async_rounds_apply_each_push_share_the_budget_and_leave() -> None:
    """Plain SGD outer step (lr 1, no momentum): theta <- theta - g with g = theta_pulled - theta_local, so the
    global model moves by each worker's own change. Budget 6 = 2 workers x 3 steps, rounds of H = 2."""
    settings = OuterSettings(local_steps=2, outer_lr=1.0, outer_momentum=0.0, delayed_nesterov=False,
                             dynamic_local_steps=False)
    server, network, (m0, m1) = _start(settings, budget=6)
    w0, w1 = Worker(m0, CPU, server.local), Worker(m1, CPU, network.ends[1])
    w0.exchange(Kind.HELLO)  # H = 2, budget left 6
    w1.exchange(Kind.HELLO)  # min(H, 6 - 2 in flight) = 2
    _round(w0, m0, [1.0, 2.0], 4.0, 2)  # g = [0, 0] - [1, 2]: theta = [1, 2]; buffers = mean{[4]} = [4]
    assert m0.w.tolist() == [1.0, 2.0] and m0.stat.tolist() == [4.0]  # w0 pulled the global model
    _round(w1, m1, [3.0, 0.0], 2.0, 2)  # g = [-3, 0]: theta = [4, 2]; buffers = mean{[4], [2]} = [3]
    assert w1.stopped and m1.w.tolist() == [3.0, 0.0]  # 4 done + 2 in flight for w0 = 6: stop, no model
    _round(w0, m0, [2.0, 2.0], 6.0, 2)  # g = [1, 2] - [2, 2] = [-1, 0]: theta = [5, 2]; buffers = [4]
    assert w0.stopped
    w0.exchange(Kind.BYE)
    w1.exchange(Kind.BYE)
    server.join()  # every worker left: both threads end
    outer = server.outer
    assert outer.params.tolist() == [5.0, 2.0] and outer.buffers.tolist() == [4.0]
    assert (outer.steps_done, outer.outer_updates) == (6, 3)
    assert w0.rounds == [(2, 0), (2, 1), (0, 3)] and w1.rounds == [(2, 0), (0, 2)]
    assert outer.workers[1].staleness == 1  # w0's push landed between w1's pull and push
    assert m0.count.tolist() == [0]  # integer buffers never travel


def test_sync_round_applies_the_mean_once_and_ships_inner_states() -> None:
    """DiLoCo: both pushes, one outer step with their mean; every worker pulls the same model. Each worker runs
    in its own thread (a sync batch waits for both)."""
    settings = OuterSettings(mode="sync", local_steps=2, outer_lr=1.0, outer_momentum=0.0)
    server, network, modules = _start(settings, budget=4)
    inner = torch.optim.SGD(modules[0].parameters(), lr=0.25)
    workers = [Worker(modules[0], CPU, server.local, inner), Worker(modules[1], CPU, network.ends[1])]
    local = {0: ([1.0, 1.0], 2.0), 1: ([3.0, -1.0], 6.0)}

    def run(w: int) -> None:
        workers[w].exchange(Kind.HELLO)  # H = min(2, (4 - 0) // 2) = 2
        _round(workers[w], modules[w], *local[w], 2)  # mean g = -[2, 0]: theta = [2, 0]; buffers = [4]
        workers[w].exchange(Kind.BYE)

    threads = [threading.Thread(target=run, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.join()
    outer = server.outer
    assert outer.params.tolist() == [2.0, 0.0] and outer.buffers.tolist() == [4.0] and outer.outer_updates == 1
    assert [w.rounds for w in workers] == [[(2, 0), (0, 1)]] * 2  # budget spent: both stop
    assert outer.state_dict()["inner_optimizer_states"][0]["param_groups"][0]["lr"] == 0.25
    assert set(outer.inner_states) == {0}  # worker 1 sends none


def test_a_failed_server_wakes_rank_zeros_worker() -> None:
    outer = mock.create_autospec(OuterState, instance=True)
    outer.params, outer.step_policy = torch.zeros(2), AsyncStep()
    outer.process.side_effect = RuntimeError("outer step failed")
    remote = mock.create_autospec(ServerTransport, instance=True)
    remote.receive.side_effect = lambda: queue.Queue().get(timeout=60)  # no remote message ever comes
    server = Server(outer, workers=2, remote=remote, timeout=60)
    server.start()
    worker = Worker(Tiny(), CPU, server.local)
    with pytest.raises(RuntimeError, match="server on rank 0 failed") as error:
        worker.exchange(Kind.HELLO)
    assert "outer step failed" in str(error.value.__cause__)
