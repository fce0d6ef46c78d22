"""Whole rounds in one process: rank 0's exchange (outer state and server) and the other workers' exchanges, wired
as the strategy wires them (:class:`~lightning_hdet.asynchronous.exchange.exchange.Exchange`) but over the in-memory
transport, so every message is encoded, queued and decoded as it would cross the wire. The local steps are stood in
for by writing the model a round would leave; the global models are computed by hand in the docstrings."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from lightning_hdet.asynchronous.exchange.exchange import Exchange
from lightning_hdet.asynchronous.exchange.ranks import WorkerRanks
from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, Nesterov
from lightning_hdet.asynchronous.outer.local_steps import AdaptiveSteps
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import Int8
from lightning_hdet.asynchronous.wire.messages import Kind, WorkerHeader
from lightning_hdet.testing import MemoryTransport

CPU = torch.device("cpu")
HEADER = 8 * WorkerHeader.SIZE  # a push's float64 header, in bytes


class Model(nn.Module):
    """One parameter of ``shape`` and one floating-point buffer."""

    def __init__(self, shape: Sequence[int] = (2,)) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(shape))
        self.register_buffer("stat", torch.zeros(1))

    def set(self, w: Sequence[float] | torch.Tensor, stat: float = 0.0) -> None:
        with torch.no_grad():
            self.w.copy_(torch.as_tensor(w, dtype=torch.float32).view_as(self.w))
            self.stat.fill_(stat)


class World:
    """``workers`` exchanges in this process over one :class:`MemoryTransport`; worker 0 holds the outer state."""

    def __init__(self, settings: OuterSettings, workers: int, budget: int | None, shape: Sequence[int] = (2,),
                 **options) -> None:
        self.network = MemoryTransport(timeout=30)
        self.modules = [Model(shape) for _ in range(workers)]
        outer = Exchange.start_outer(settings, self.modules[0], CPU, workers, budget, None)
        self.exchanges = [Exchange(module, CPU, (), workers, 30, outer=outer if w == 0 else None,
                                   ranks=WorkerRanks(workers, 1, w), transport=self.network, **options)
                          for w, module in enumerate(self.modules)]
        self.outer = outer

    @property
    def params(self) -> list[float]:
        return self.outer.params.tolist()

    def round(self, w: int, local: Sequence[float] | torch.Tensor, stat: float = 0.0) -> None:
        """Worker ``w`` ends its round with ``local`` (and ``stat``) and exchanges."""
        worker = self.exchanges[w].worker
        self.modules[w].set(local, stat)
        while not worker.step():  # the round's steps, counted
            pass
        worker.exchange(Kind.PUSH)

    def together(self, run: Callable[[int], None]) -> None:
        """``run(w)`` for every worker at once, one thread each (a DiLoCo round waits for every push)."""
        errors: list[BaseException] = []

        def guarded(w: int) -> None:
            try:
                run(w)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=guarded, args=(w,)) for w in range(len(self.exchanges))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]

    def leave(self) -> None:
        self.together(lambda w: self.exchanges[w].worker.exchange(Kind.BYE))
        self.exchanges[0].server.join()


def test_a_diloco_round_of_three_workers_is_one_nesterov_step_on_the_mean() -> None:
    """lr 0.5, momentum 0.5 (``m = 0.5 m + g``, ``theta -= 0.5 (g + 0.5 m)``), from [0, 0], H = 2, budget 12.
    Round 1 leaves [1, 0], [2, 0], [0, 3] (stats 1, 2, 6): g = -[1, 1], m = g, theta = 0.75 * [1, 1], buffers 3.
    Round 2 from there, worker 0 moves by [3, 0]: g = [-1, 0], m = [-1.5, -0.5], theta = [0.75, 0.75] - 0.5 *
    [-1.75, -0.25] = [1.625, 0.875], buffers (3 + 0 + 0) / 3 = 1. The budget is spent: every reply says stop."""
    world = World(OuterSettings(mode="sync", local_steps=2, outer=Nesterov(lr=0.5, momentum=0.5)), 3, 12)
    first = {0: ([1.0, 0.0], 1.0), 1: ([2.0, 0.0], 2.0), 2: ([0.0, 3.0], 6.0)}
    pulled: list[list[float]] = [[], [], []]

    def run(w: int) -> None:
        world.exchanges[w].worker.exchange(Kind.HELLO)
        world.round(w, *first[w])
        pulled[w] = world.modules[w].w.tolist() + world.modules[w].stat.tolist()
        world.round(w, [3.75, 0.75] if w == 0 else [0.75, 0.75], 3.0 if w == 0 else 0.0)

    world.together(run)
    assert pulled == [[0.75, 0.75, 3.0]] * 3  # every worker restarts from the same global model
    assert all(e.worker.stopped for e in world.exchanges)
    world.leave()
    assert world.params == [1.625, 0.875] and world.outer.buffers.tolist() == [1.0]
    assert world.outer.outer_updates == 2 and world.outer.steps_done == 12
    assert [e.worker.rounds for e in world.exchanges] == [[(2, 0), (2, 1), (0, 2)]] * 3


def test_async_stale_pushes_in_a_given_order_under_delayed_nesterov() -> None:
    """Delayed Nesterov, N = 2 workers, lr 0.5, momentum 0.5, c = 0: each push moves theta by ``-lr g / 2``; the
    second of a cycle also by ``-lr * 0.5 * m``, where ``m = 0.5 m`` at a cycle's first push, ``+ g / 2`` at each.
    Both pull [0, 0]. Worker 1 pushes g = -[2, 0]: m = [-1, 0], theta = [0.5, 0]. Worker 0, stale by one update,
    pushes g = -[0, 4]: m = [-1, -2], theta = [0.5, 0] + [0.25, 0.5] + [0, 1] = [0.75, 1.5]. Worker 1 from [0.5, 0]
    pushes g = -[0, 1] (a new cycle): m = [-0.5, -1.5], theta = [0.75, 1.75]."""
    settings = OuterSettings(local_steps=2, outer=DelayedNesterov(lr=0.5, momentum=0.5))
    world = World(settings, 2, None)
    for e in world.exchanges:
        e.worker.exchange(Kind.HELLO)
    world.round(1, [2.0, 0.0])
    assert world.params == [0.5, 0.0] and world.modules[1].w.tolist() == [0.5, 0.0]
    world.round(0, [0.0, 4.0])
    assert world.params == [0.75, 1.5] and world.outer.workers[0].staleness == 1
    world.round(1, [0.5, 1.0])
    assert world.params == [0.75, 1.75]
    world.leave()
    assert world.exchanges[0].worker.rounds == [(2, 0), (2, 2)]
    assert world.exchanges[1].worker.rounds == [(2, 0), (2, 1), (2, 3)]
    assert world.network.bytes["push"][1] == 4 * HEADER + 2 * (8 + 4)  # hello, 2 pushes (2 values, a buffer), bye


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_non_finite_push_is_rejected_whole_and_its_worker_restarts_from_the_global_model(mode: str) -> None:
    """Plain SGD outer step (lr 1, no momentum), from [1, 1]; workers do not check themselves, the server does.
    Worker 1's round is [nan, 5]: rejected whole, theta keeps no trace of its finite value; worker 0's [3, 1]
    applies (async: theta = [3, 1]; DiLoCo: the mean of the pushes that passed, the same). Worker 1 is told it was
    rejected and pulls the global model."""
    settings = OuterSettings(mode=mode, local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    world = World(settings, 2, None, check_self=False)
    world.outer.params.fill_(1.0)
    world.together(lambda w: world.exchanges[w].worker.exchange(Kind.HELLO))
    push = {0: [3.0, 1.0], 1: [float("nan"), 5.0]}
    if mode == "async":  # in order: worker 1's reply comes after worker 0's push is applied (no race to pull)
        for w in (0, 1):
            world.round(w, push[w])
    else:  # DiLoCo's round closes only with both pushes
        world.together(lambda w: world.round(w, push[w]))
    assert world.params == [3.0, 1.0]
    bad = world.exchanges[1].worker
    assert bad.rejected == 1 and world.outer.workers[1].rejected == 1
    assert world.modules[1].w.tolist() == [3.0, 1.0]  # restarted from the global model
    world.leave()
    assert world.params == [3.0, 1.0]


def test_a_worker_rejected_max_rejections_times_stops_and_delayed_nesterovs_n_follows_the_others() -> None:
    """Async, 3 workers, Delayed Nesterov at lr 1 and no momentum (each push moves theta by -g / N). Worker 2's
    rounds are non-finite three times: each rejected, the third reply says stop. N follows the 2 workers left (no
    push is buffered: a momentum boundary), so worker 0's [1, 0] and worker 1's [0, 2] move theta by half each."""
    settings = OuterSettings(local_steps=2, check_pushes=PushCheck(max_rejections=3),
                             outer=DelayedNesterov(lr=1.0, momentum=0.0))
    world = World(settings, 3, None, check_self=False)
    for e in world.exchanges:
        e.worker.exchange(Kind.HELLO)
    for _ in range(3):
        world.round(2, [float("nan"), 1.0])
    bad = world.exchanges[2].worker
    assert bad.stopped and bad.rejected == 3 and world.params == [0.0, 0.0]
    world.round(0, [1.0, 0.0])
    world.round(1, [0.0, 2.0])
    assert world.params == [0.5, 1.0] and world.outer.optimizer.param_groups[0]["buffer_size"] == 2
    assert not any(e.worker.stopped for e in world.exchanges[:2])
    world.leave()
    assert world.outer.workers[2].rejected == 3 and world.outer.workers[2].steps == 0


def test_int8_pushes_decode_within_half_a_row_scale_and_send_a_quarter_of_the_bytes() -> None:
    """DiLoCo, 2 workers, plain SGD outer step (lr 1): theta = -mean(decoded g). A 2 x 4 parameter is pushed in
    int8 with one float32 scale per row (``max |row| / 127``): each decoded value is within half its row's scale of
    the true one, so theta is within the mean of the two workers' half-scales of the true mean; a push is 2 x (4 +
    4) bytes instead of 32."""
    gen = torch.Generator().manual_seed(0)
    local = [torch.randn(2, 4, generator=gen) for _ in range(2)]
    settings = OuterSettings(mode="sync", local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    world = World(settings, 2, 4, shape=(2, 4), compression=Int8(), error_feedback=False)

    def run(w: int) -> None:
        world.exchanges[w].worker.exchange(Kind.HELLO)
        world.round(w, local[w])

    world.together(run)
    world.leave()
    exact = (local[0] + local[1]) / 2  # g = -local from 0
    bound = sum(x.abs().amax(dim=1, keepdim=True) / 254 for x in local) / 2  # half a scale, averaged
    error = (world.outer.params.view(2, 4) - exact).abs()
    assert bool((error <= bound + 1e-7).all()) and bool((error > 0).any())
    # hello and bye: headers; the push: header, 16 bytes of fragments, 4 of the buffer
    assert world.network.bytes["push"][1] == 3 * HEADER + 16 + 4


def test_overlapped_diloco_merges_the_global_model_with_the_steps_taken_meanwhile() -> None:
    """τ = 1 of H = 2, plain SGD outer step (lr 1), budget 8: two rounds each. Worker 0 sends at [1, 0], worker 1 at
    [3, 0] (theta = [2, 0]); each takes its overlapped step (by [0, 1], [0, 3]) and merges: theta + its own step,
    [2, 1] and [2, 3] (rank 0 in place, worker 1 from its copy of the model at the send). Their next pushes carry
    that step and one more, sent at [3, 2] and [1, 2]: theta = [2, 2], and the reply says stop (8 steps counted,
    the 2 still to come included). The overlapped steps, by [0, 2] and [0, 0], are kept and pushed with the
    goodbye: theta = [2, 3], the mean of the final models (lr 1); every step counted once."""
    settings = OuterSettings(mode="sync", local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    world = World(settings, 2, 8, overlap_steps=1)
    sent = {0: [[1.0, 0.0], [3.0, 2.0]], 1: [[3.0, 0.0], [1.0, 2.0]]}
    after = {0: [[1.0, 1.0], [3.0, 4.0]], 1: [[3.0, 3.0], [1.0, 2.0]]}  # the overlapped step's model
    merged: dict[int, list[float]] = {}

    def run(w: int) -> None:
        worker, module = world.exchanges[w].worker, world.modules[w]
        worker.exchange(Kind.HELLO)
        for r in range(2):
            module.set(sent[w][r])
            assert worker.step()  # time to send: one step before the round's end
            worker.exchange(Kind.PUSH)
            module.set(after[w][r])
            assert worker.step()  # time to merge
            worker.exchange(Kind.PUSH)
            merged.setdefault(w, module.w.tolist())

    world.together(run)
    assert merged == {0: [2.0, 1.0], 1: [2.0, 3.0]}
    assert world.params == [2.0, 2.0] and all(e.worker.stopped for e in world.exchanges)
    assert [world.modules[w].w.tolist() for w in (0, 1)] == [[3.0, 4.0], [1.0, 2.0]]  # stopped: own model kept
    world.leave()
    assert world.params == [2.0, 3.0] and world.outer.steps_done == 8


def test_a_grace_period_batches_every_workers_push_and_they_restart_from_one_version() -> None:
    """Async, 4 workers, a grace period longer than the test (60 s): a batch closes as soon as every training worker
    pushed, so each holds all four pushes, each applied on arrival (plain SGD, lr 1: theta += the worker's change),
    and every worker restarts from the same model. Worker w moves by [1, w] each round: a batch moves theta by
    [4, 6]. H = 3, budget 36: three batches, then stop."""
    settings = OuterSettings(local_steps=AdaptiveSteps(3, min=3, grace_period=60.0),
                             outer=Nesterov(lr=1.0, momentum=0.0))
    world = World(settings, 4, 36)
    pulled: dict[int, list[list[float]]] = {w: [] for w in range(4)}

    def run(w: int) -> None:
        world.exchanges[w].worker.exchange(Kind.HELLO)
        for _ in range(3):
            world.round(w, world.modules[w].w.detach() + torch.tensor([1.0, float(w)]))
            pulled[w].append(world.modules[w].w.tolist())

    world.together(run)
    world.leave()
    assert all(pulled[w][:2] == [[4.0, 6.0], [8.0, 12.0]] for w in range(4))  # then stopped: each keeps its own
    assert world.params == [12.0, 18.0] and world.outer.outer_updates == 12 and world.outer.steps_done == 36
    assert all(e.worker.rounds == [(3, 0), (3, 4), (3, 8), (0, 12)] for e in world.exchanges)
    assert all(s.staleness <= 3 for s in world.outer.workers.values())  # at most the batch's other pushes


def test_the_memory_transport_carries_bytes_and_names_a_wait_or_a_layout_that_does_not_fit() -> None:
    """A float32 message is received into a uint8 buffer of its bytes (as over gloo); a receiver of another size and
    a wait past the timeout raise, naming the worker and the way."""
    network = MemoryTransport(timeout=0.01)
    network.put("push", 1, torch.tensor([1.0, -2.0]))
    received = torch.empty(8, dtype=torch.uint8)
    network.take("push", 1, received)
    assert received.view(torch.float32).tolist() == [1.0, -2.0] and network.bytes["push"][1] == 8
    network.put("reply", 2, torch.zeros(3))
    with pytest.raises(RuntimeError, match="worker 2's reply message is torch.float32\\[3\\], its receiver expected 8"):
        network.take("reply", 2, torch.empty(2))
    with pytest.raises(TimeoutError, match="a push message of worker 1"):
        network.take("push", 1, received)
