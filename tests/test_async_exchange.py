"""The exchange without processes: the wire format, and workers + the server in one process over the in-memory
transport (as torchft tests LocalSGD with a mocked manager). Values are computed by hand in the comments.
``test_memory_rounds.py`` runs whole rounds through the strategy's own wiring."""

from __future__ import annotations

import math
import queue
import threading
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_hdet.asynchronous.exchange.server import Server
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, Nesterov
from lightning_hdet.asynchronous.outer.local_steps import AdaptiveSteps
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.outer.state import OuterState
from lightning_hdet.asynchronous.outer.state import AsyncStep
from lightning_hdet.asynchronous.wire.codecs import codec_from
from lightning_hdet.asynchronous.wire.messages import (
    Fragments,
    Kind,
    Push,
    ServerHeader,
    WorkerHeader,
    fragment_layout,
)
from lightning_hdet.asynchronous.wire.memory import MemoryServerEnd, MemoryTransport
from lightning_hdet.asynchronous.wire.network import Link
from lightning_hdet.asynchronous.wire.transport import (
    GlooWorkerTransport,
    ServerTransport,
    WorkerTransport,
    receive_reply,
    send_reply,
)

CPU = torch.device("cpu")


class Recorded(MemoryTransport):
    """The in-memory transport, keeping a copy of every message it carries: ``log[(way, worker)]``."""

    def __init__(self) -> None:
        super().__init__(timeout=60)
        self.log: dict[tuple[str, int], list[torch.Tensor]] = {}

    def put(self, way: str, worker: int, tensor: torch.Tensor) -> None:
        self.log.setdefault((way, worker), []).append(tensor.clone())
        super().put(way, worker, tensor)


class Network:
    """Rank 0's end and workers' ends of one in-memory transport, as :class:`Server` and :class:`Worker` take them."""

    def __init__(self, layout: Fragments, workers: list[int], n_buffers: int = 1,
                 end: type[MemoryServerEnd] = MemoryServerEnd) -> None:
        self.memory = Recorded()
        link = Link(layout, n_buffers)
        self.server_end = end(self.memory, layout, n_buffers)
        self.ends = {w: self.memory.worker_end(link, w) for w in workers}


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


def _start(settings: OuterSettings, budget: int | None, layout: Fragments | None = None,
           start: list[float] | None = None) -> tuple[Server, Network, list[Tiny]]:
    modules = [Tiny(), Tiny()]
    layout = layout or Fragments([torch.Size([2])])
    params = torch.zeros(2) if start is None else torch.tensor(start)
    outer = settings.build(params, torch.zeros(1), workers=2, budget=budget, ranges=layout.ranges)
    network = Network(layout, workers=[1])
    server = Server(outer, workers=2, remote=network.server_end, timeout=60, layout=layout)
    server.start()
    return server, network, modules


def _round(worker: Worker, module: Tiny, w: list[float], stat: float, steps: int) -> None:
    module.set(w, stat)
    assert [worker.step() for _ in range(steps)][-1]  # the round is complete after `steps` steps
    worker.exchange(Kind.PUSH)


def _one_round_each(server: Server, workers: list[Worker], modules: list[Tiny],
                    local: dict[int, tuple[list[float], float]] | None = None) -> None:
    """Each worker in its own thread (a sync batch waits for both): hello, one round of 2 steps leaving
    ``local[w]``'s (w, stat) (default w = [1, 1], stat 2 for worker 0 and w = [3, -1], stat 6 for worker 1), then
    leave; wait for the server to end. Both pull the starting model before either pushes (async: else the later
    hello pulls the first push)."""
    local = local or {0: ([1.0, 1.0], 2.0), 1: ([3.0, -1.0], 6.0)}
    pulled = threading.Barrier(2, timeout=60)

    def run(w: int) -> None:
        workers[w].exchange(Kind.HELLO)
        pulled.wait()
        _round(workers[w], modules[w], *local[w], 2)
        workers[w].exchange(Kind.BYE)

    threads = [threading.Thread(target=run, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    server.join()


# --------------------------------------------------------------------------------------------- the wire format
def test_kinds_are_the_documented_numbers() -> None:
    assert [int(k) for k in (Kind.HELLO, Kind.PUSH, Kind.BYE)] == [0, 1, 2]


def test_worker_header_round_trip() -> None:
    header = WorkerHeader(Kind.PUSH, steps=37, compute_s=1.25, wait_s=0.5, inner_state_bytes=2**40 + 3, pending=4,
                          part=2)
    raw = header.encode()
    assert raw.dtype == torch.float64 and raw.tolist() == [1.0, 37.0, 1.25, 0.5, float(2**40 + 3), 4.0, 2.0]
    assert WorkerHeader.decode(raw) == header
    assert WorkerHeader.decode(WorkerHeader(Kind.BYE, 0, 0.0, 0.0).encode()).kind is Kind.BYE


def test_server_header_round_trip_and_bad_sizes() -> None:
    header = ServerHeader(next_local_steps=12, outer_updates=345, rejected=2)
    # -1: the parameters themselves, all parts; 0: no checkpoint requests yet
    assert header.encode().tolist() == [12.0, 345.0, 2.0, -1.0, -1.0, 0.0]
    assert ServerHeader.decode(header.encode()) == header
    assert ServerHeader.decode(ServerHeader(4, 5, 0, deltas=3).encode()).deltas == 3
    assert ServerHeader.decode(ServerHeader(4, 5, checkpoints=7).encode()).checkpoints == 7
    with pytest.raises(ValueError, match=r"server header is float64\[6\], got torch.float64\[4\]"):
        ServerHeader.decode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="worker header"):
        WorkerHeader.decode(torch.zeros(5, dtype=torch.float32))


def test_push_of_a_header_counts_its_payload() -> None:
    header = WorkerHeader(Kind.PUSH, 4, 2.0, 0.1)
    push = Push.of(3, header, torch.tensor([9.0]), gradient_bytes=12)
    assert (push.worker, push.kind, push.steps, push.compute_s, push.wait_s) == (3, Kind.PUSH, 4, 2.0, 0.1)
    assert push.pseudo_gradient is None and push.buffers.tolist() == [9.0]
    assert push.payload_bytes == 12 + 4  # the encoded fragments, then one float32 buffer value
    hello = Push.of(1, WorkerHeader(Kind.HELLO, 0, 0.0, 0.0), None, gradient_bytes=12)
    assert hello.pseudo_gradient is None and hello.buffers is None and hello.payload_bytes == 0


def test_gloo_worker_sends_header_buffers_inner_state_then_fragments_in_order() -> None:
    layout = Fragments([torch.Size([2]), torch.Size([3])], max_bytes=12)  # two fragments: 2 and 3 values
    fragments = iter([torch.ones(8, dtype=torch.uint8), torch.ones(12, dtype=torch.uint8)])
    with mock.patch("torch.distributed.send") as send:
        GlooWorkerTransport("pushes", "replies", layout, 1).push(
            WorkerHeader(Kind.PUSH, 2, 1.0, 0.0, 5), fragments, torch.ones(1), torch.zeros(5, dtype=torch.uint8))
    sent = [(c.args[0].dtype, c.args[0].numel(), c.kwargs["dst"], c.kwargs["group"]) for c in send.call_args_list]
    assert sent == [(torch.float64, 7, 0, "pushes"), (torch.float32, 1, 0, "pushes"), (torch.uint8, 5, 0, "pushes"),
                    (torch.uint8, 8, 0, "pushes"), (torch.uint8, 12, 0, "pushes")]


# ------------------------------------------------------------------------- workers and the server, one process
def test_async_rounds_apply_each_push_share_the_budget_and_leave() -> None:
    """Plain SGD outer step (lr 1, no momentum): theta <- theta - g with g = theta_pulled - theta_local, so the
    global model moves by each worker's own change. Budget 6 = 2 workers x 3 steps, rounds of H = 2."""
    settings = OuterSettings(local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
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
    """DiLoCo: both pushes, one outer step with their mean; every worker pulls the same model; buffers [4]."""
    settings = OuterSettings(mode="sync", local_steps=2, outer=DelayedNesterov(lr=1.0, momentum=0.0))
    server, network, modules = _start(settings, budget=4)
    inner = torch.optim.SGD(modules[0].parameters(), lr=0.25)
    workers = [Worker(modules[0], CPU, server.local, inner), Worker(modules[1], CPU, network.ends[1])]
    _one_round_each(server, workers, modules)  # H = min(2, 4 // 2) = 2; mean g = -[2, 0]: theta = [2, 0]
    outer = server.outer
    assert outer.params.tolist() == [2.0, 0.0] and outer.buffers.tolist() == [4.0] and outer.outer_updates == 1
    assert [w.rounds for w in workers] == [[(2, 0), (0, 1)]] * 2  # budget spent: both stop
    assert outer.state_dict()["inner_optimizer_states"][0]["param_groups"][0]["lr"] == 0.25
    assert set(outer.inner_states) == {0}  # worker 1 sends none


def test_int8_pushes_with_error_feedback_reach_the_true_sum() -> None:
    """int8 pushes (one scale per 2-value chunk) through the fake transport; worker 0 keeps its residual and sends
    it with its next push, worker 1 has no error feedback. Plain SGD outer step (lr 1): theta <- theta - decoded g."""
    layout = Fragments([torch.Size([2])], "int8")
    settings = OuterSettings(local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    server, network, (m0, m1) = _start(settings, budget=6, layout=layout)
    w0 = Worker(m0, CPU, server.local, layout=layout)
    w1 = Worker(m1, CPU, network.ends[1], layout=layout, error_feedback=False)
    w0.exchange(Kind.HELLO)
    w1.exchange(Kind.HELLO)
    # g = [-1, -0.5]: scale 1/127, q = [-127, -64] (-63.5, half to even): theta = [1, 64/127], residual [0, 0.5/127]
    _round(w0, m0, [1.0, 0.5], 0.0, 2)
    assert m0.w.tolist() == pytest.approx([1.0, 64 / 127]) and w0.feedback.residual.tolist() == pytest.approx(
        [0.0, 0.5 / 127])
    _round(w1, m1, [3.0, 0.0], 0.0, 2)  # g = [-3, 0], exact in int8: theta = [4, 64/127]; budget: w1 stops
    assert w1.stopped and w1.feedback.residual.numel() == 0
    _round(w0, m0, m0.w.tolist(), 0.0, 2)  # no change, but the residual travels: theta = [4, 0.5]
    w0.exchange(Kind.BYE)
    w1.exchange(Kind.BYE)
    server.join()
    outer = server.outer
    assert outer.params.tolist() == pytest.approx([4.0, 0.5], abs=1e-6)  # the true sum of the changes
    # each push: one float32 scale + 2 int8 values + the float32 buffer value = 10 bytes
    assert outer.workers[0].push_bytes == 20 and outer.workers[1].push_bytes == 10


def test_a_failed_server_wakes_rank_zeros_worker() -> None:
    outer = mock.create_autospec(OuterState, instance=True)
    outer.params, outer.step_policy, outer.ranges = torch.zeros(2), AsyncStep(), [(0, 2)]
    outer.close.side_effect = RuntimeError("outer step failed")
    remote = mock.create_autospec(ServerTransport, instance=True)
    remote.receive.side_effect = lambda: queue.Queue().get(timeout=60)  # no remote message ever comes
    server = Server(outer, workers=2, remote=remote, timeout=60)
    server.start()
    worker = Worker(Tiny(), CPU, server.local)
    with pytest.raises(RuntimeError, match="server on rank 0 failed") as error:
        worker.exchange(Kind.HELLO)
    assert "outer step failed" in str(error.value.__cause__)


class EagerEnd(MemoryServerEnd):
    """Worker 1 is fast: as soon as it is replied to, it pushes its next round (and the test gives the server a
    second to apply it) before the server goes on to reply to the batch's other workers."""

    outer: OuterState
    worker: WorkerTransport
    raced = False

    def reply(self, worker: int, header: ServerHeader, params, buffers: torch.Tensor) -> None:
        super().reply(worker, header, params, buffers)
        if worker == 1 and header.next_local_steps > 0 and not self.raced:
            self.raced = True
            self.worker.push(WorkerHeader(Kind.PUSH, steps=2, compute_s=0.1, wait_s=0.0), [torch.tensor([1.0, -1.0])],
                             None, None)
            for _ in range(100):  # without the reply gate, the push is applied within milliseconds
                if self.outer.outer_updates:
                    break
                threading.Event().wait(0.01)


def test_every_worker_of_a_batch_restarts_from_the_same_version() -> None:
    """Grace period 60 s, three workers: worker 1 is replied to first and pushes again at once; that push waits
    until worker 2 has been sent, and rank 0's own worker has pulled, the batch's version (0, the start)."""
    settings = OuterSettings(mode="async", local_steps=AdaptiveSteps(2, min=2, grace_period=60.0),
                             outer=Nesterov(lr=1.0, momentum=0.0))
    layout = Fragments([torch.Size([2])])
    outer = settings.build(torch.zeros(2), torch.zeros(0), workers=3, budget=None, ranges=layout.ranges)
    network = Network(layout, [1, 2], n_buffers=0, end=EagerEnd)
    network.server_end.outer, network.server_end.worker = outer, network.ends[1]
    server = Server(outer, workers=3, remote=network.server_end, timeout=60, layout=layout)
    server.start()
    hello = WorkerHeader(Kind.HELLO, steps=0, compute_s=0.0, wait_s=0.0)
    for w in (1, 2):
        network.ends[w].push(hello, [], None, None)
    server.local.push(hello, [], None, None)
    pulled = torch.full((2,), float("nan"))
    local = server.local.pull(pulled)
    remote = {w: network.ends[w].pull(torch.empty(2)) for w in (1, 2)}
    assert network.server_end.raced
    assert [local.outer_updates, remote[1].outer_updates, remote[2].outer_updates] == [0, 0, 0]
    assert pulled.tolist() == [0.0, 0.0]  # the start, without worker 1's next round in it
    bye = WorkerHeader(Kind.BYE, steps=0, compute_s=0.0, wait_s=0.0)
    server.local.push(bye, [], None, None)
    network.ends[2].push(bye, [], None, None)
    # then its push was applied
    assert network.ends[1].pull(torch.empty(2)).outer_updates == 1
    network.ends[1].push(bye, [], None, None)
    server.join()
    assert outer.params.tolist() == [-1.0, 1.0]  # outer LR 1, no momentum: minus the pseudo-gradient


# ------------------------------------------------------------------------------- fragments: pure, then streamed
def test_fragment_layout_groups_parameters_and_cuts_large_ones() -> None:
    """At most 8 values per fragment: a (3, 4) matrix is cut into row blocks (2 rows, then 1), a (10, 2) one into
    4 + 4 + 2 rows, a flat 20-vector into chunks of 8, 8, 4; small pieces share a fragment while they fit."""
    shapes = [torch.Size([3, 4]), torch.Size([5]), torch.Size([0]), torch.Size([10, 2]), torch.Size([20])]
    layout = fragment_layout(shapes, max_values=8)
    assert [(f.start, [tuple(s) for s in f.shapes]) for f in layout] == [
        (0, [(2, 4)]), (8, [(1, 4)]), (12, [(5,)]), (17, [(4, 2)]), (25, [(4, 2)]), (33, [(2, 2)]),
        (37, [(8,)]), (45, [(8,)]), (53, [(4,)])]
    assert layout[-1].end == 57 == sum(s.numel() for s in shapes)
    packed = fragment_layout([torch.Size([2]), torch.Size([3]), torch.Size([4])], max_values=5)
    assert [f.shapes for f in packed] == [(torch.Size([2]), torch.Size([3])), (torch.Size([4]),)]
    with pytest.raises(ValueError, match="at least one value"):
        fragment_layout(shapes, max_values=0)


@pytest.mark.parametrize("name", ["none", "bf16", "int8"])
def test_fragments_reassemble_what_the_whole_codec_sends(name: str) -> None:
    """Split, encoded fragment by fragment and joined, a vector decodes to exactly what one message of the whole
    vector decodes to, in as many bytes: row blocks and 256-value chunks keep every int8 scale."""
    shapes = [torch.Size([300, 4]), torch.Size([1000]), torch.Size([7])]
    flat = torch.randn(sum(s.numel() for s in shapes), generator=torch.Generator().manual_seed(0))
    layout = Fragments(shapes, name, max_bytes=4 * 512)  # 512 values: 128 rows, or 2 chunks of 256
    assert len(layout.fragments) > 3 and layout.largest <= 512
    whole = codec_from(name).bind(shapes)
    assert layout.nbytes == whole.nbytes
    torch.testing.assert_close(layout.join(layout.encode(flat)), whole.decode(whole.encode(flat.clone())),
                               rtol=0, atol=0)
    assert [v.data_ptr() for v in layout.split(flat)] == [flat[s:].data_ptr() for s, _ in layout.ranges]  # views


@pytest.mark.parametrize("check_pushes", [False, True])
def test_the_server_applies_each_fragment_as_it_arrives_or_once_checked(check_pushes: bool) -> None:
    """A push of three fragments (a 5-value model in fragments of at most 2 values). Unchecked: when fragment
    k+1 is asked for, fragment k is already in the global parameters (plain SGD outer step, lr 1: theta <- theta -
    g). Checked: nothing is applied before the last fragment arrived (they wait in the staging buffer). The
    server decodes into one fragment-sized buffer."""
    layout = Fragments([torch.Size([5])], max_bytes=8)
    settings = OuterSettings(local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0),
                             check_pushes=check_pushes)
    outer = settings.build(torch.zeros(5), torch.zeros(0), workers=1, budget=None, ranges=layout.ranges)
    server = Server(outer, workers=1, remote=None, timeout=60, layout=layout)
    assert server._decoded.numel() == 2 and len(outer.views) == 3

    def arriving():
        for k, (start, end) in enumerate(layout.ranges):
            applied = 0 if check_pushes else start
            assert outer.params[:applied].tolist() == [-1.0] * applied  # fragments 0..k-1 applied (unchecked)
            assert outer.params[applied:].tolist() == [0.0] * (5 - applied)
            yield torch.ones(end - start).view(torch.uint8)

    server.accept(Push.of(0, WorkerHeader(Kind.PUSH, 2, 1.0, 0.0), gradient_bytes=layout.nbytes), arriving())
    assert outer.params.tolist() == [-1.0] * 5 and outer.outer_updates == 1 and outer.workers[0].push_bytes == 20


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_streamed_rounds_match_the_whole_vector_rounds(mode: str) -> None:
    """Two workers, pushes and pulls of Tiny's 2-value parameter in fragments of one value each: the global model
    is the hand-computed one, and the reply travelled fragment by fragment. Outer step plain SGD, lr 1 (sync:
    theta <- theta - mean g)."""
    layout = Fragments([torch.Size([2])], max_bytes=4)  # one value per fragment
    settings = OuterSettings(mode=mode, local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    server, network, modules = _start(settings, budget=4, layout=layout)
    workers = [Worker(modules[0], CPU, server.local, layout=layout),
               Worker(modules[1], CPU, network.ends[1], layout=layout)]
    _one_round_each(server, workers, modules)
    outer = server.outer
    # async: theta = -(g0 + g1) = [4, 0]; sync: theta = -(g0 + g1) / 2 = [2, 0]; buffers: mean [4]
    assert outer.params.tolist() == ([4.0, 0.0] if mode == "async" else [2.0, 0.0])
    assert outer.buffers.tolist() == [4.0] and outer.steps_done == 4
    hello_reply, *fragments, buffer, stop = network.memory.log["reply", 1]
    assert [p.view(torch.float32).tolist() for p in fragments] == [[0.0], [0.0]]  # two 1-value fragments
    assert ServerHeader.decode(stop).next_local_steps == 0 and buffer.tolist() == [0.0]  # then stop, no model


# ------------------------------------------------------------------------------------------ compressed pulls
def test_a_bf16_pull_rounds_each_fragment_to_nearest_bfloat16() -> None:
    """Two fragments (3 values, then a 2 x 2 parameter) sent by the real wire code: 2 bytes per value, each value
    the nearest bfloat16 (spacing 2**-7 at 1), the buffers in float32; rank 0's own pull gets the same values."""
    layout = Fragments([torch.Size([3]), torch.Size([2, 2])], pull_compression="bf16", max_bytes=16)
    params = torch.tensor([1 + 2**-10, 1 + 3 * 2**-9, -2.0, 0.1, 0.5, 3 + 2**-6, 1e-3])
    wire: list[torch.Tensor] = []
    send_reply(lambda t: wire.append(t.clone()), ServerHeader(5, 3),
               layout.encode_pull(params, layout.pull_buffer()), torch.tensor([0.25]))
    assert [t.numel() for t in wire[1:3]] == [6, 8] == [c.nbytes for c in layout.pull_codecs]
    assert layout.pull_nbytes == 14 == 2 * params.numel()
    into = torch.empty(8)
    it = iter(wire)
    header = receive_reply(lambda t: t.copy_(next(it)), layout, into, layout.pull_buffer())
    assert header == ServerHeader(5, 3)
    assert into[:3].tolist() == [1.0, 1.0078125, -2.0]  # 1 + 2**-10 -> 1; 1 + 3 * 2**-9 -> 1 + 2**-7
    torch.testing.assert_close(into[:7], params.bfloat16().float(), rtol=0, atol=0)
    assert into[7].item() == 0.25
    own = torch.empty(7)
    layout.pull_into(params, own, layout.pull_buffer())
    assert torch.equal(own, into[:7])


def test_bf16_pulls_leave_workers_rounded_and_the_global_model_exact() -> None:
    """DiLoCo over two workers with bf16 pulls, outer plain SGD lr 1: both workers start from the rounded
    global model [1, 1 + 2**-7], yet the global model keeps its float32 offset: g0 = [0, 2**-7], g1 = [-2,
    2 + 2**-7], theta = start - mean g = [2 + 2**-10, 1 + 3 * 2**-9 - 1 - 2**-7]."""
    layout = Fragments([torch.Size([2])], pull_compression="bf16", max_bytes=4)
    settings = OuterSettings(mode="sync", local_steps=2, outer=DelayedNesterov(lr=1.0, momentum=0.0))
    server, network, modules = _start(settings, budget=4, layout=layout, start=[1 + 2**-10, 1 + 3 * 2**-9])
    workers = [Worker(modules[0], CPU, server.local, layout=layout),
               Worker(modules[1], CPU, network.ends[1], layout=layout)]
    _one_round_each(server, workers, modules)
    for worker in workers:  # the hello's pull (leaving pulls nothing)
        assert worker.pulled[:2].tolist() == [1.0, 1.0078125]
    assert server.outer.params.tolist() == [2 + 2**-10, 1 + 3 * 2**-9 - 1.0078125]


def test_topk2_pulls_send_workers_the_public_model_and_keep_the_global_model_exact() -> None:
    """DiLoCo over two workers with topk2 pulls (one value of the two kept, 2 bits), outer plain SGD lr 1, from [0,
    0]: the hellos send the model itself (8 bytes, plus the buffer's 4). Round 1 leaves w = [1, 1] and [3, -2]: g =
    [-1, -1], [-3, 2], so G = [2, -0.5]. The change sent keeps only the larger value: both workers (rank 0 by
    reading it) hold P = [2, 0], and G - P = [0, -0.5] waits for the next change. Worker 1's reply: 4 bytes of scale,
    2 of position, 1 of levels, plus the buffer: 11 bytes; rank 0's own pull travels nowhere (0 bytes)."""
    layout = Fragments([torch.Size([2])], pull_compression="topk2")
    settings = OuterSettings(mode="sync", local_steps=2, outer=DelayedNesterov(lr=1.0, momentum=0.0), check_pushes=False)
    server, network, modules = _start(settings, budget=8, layout=layout)
    workers = [Worker(modules[0], CPU, server.local, layout=layout),
               Worker(modules[1], CPU, network.ends[1], layout=layout)]
    _one_round_each(server, workers, modules, local={0: ([1.0, 1.0], 2.0), 1: ([3.0, -2.0], 6.0)})
    assert server.outer.params.tolist() == [2.0, -0.5]
    assert server.public is not None and server.public.params.tolist() == pytest.approx([2.0, 0.0])
    for worker in workers:
        assert torch.equal(worker.pulled[:2], server.public.params)
    stats = server.outer.worker_stats()
    assert (stats[1]["pull_bytes"], stats[1]["dense_pulls"]) == (12 + 11, 1)
    assert (stats[0]["pull_bytes"], stats[0]["dense_pulls"]) == (0, 0)


# ------------------------------------------------------------------------------- rank 0 validating the global model
def test_swap_pulled_exchanges_the_module_and_the_pulled_model_one_fragment_at_a_time() -> None:
    """Fragments of one value: the swap goes through a one-value buffer, across the parameter and the buffer; the
    integer buffer is never touched; swapping again restores both."""
    module = Tiny()
    module.set([1.0, 2.0], 3.0)
    module.count.fill_(9)
    worker = Worker(module, CPU, Network(Fragments([torch.Size([2])]), [1]).ends[1],
                    layout=Fragments([torch.Size([2])], max_bytes=4))
    assert worker.fragment.numel() == 1
    worker.pulled.copy_(torch.tensor([5.0, 6.0, 7.0]))
    worker.swap_pulled()
    assert module.w.tolist() == [5.0, 6.0] and module.stat.tolist() == [7.0] and module.count.item() == 9
    assert worker.pulled.tolist() == [1.0, 2.0, 3.0]
    worker.swap_pulled()
    assert module.w.tolist() == [1.0, 2.0] and module.stat.tolist() == [3.0]
    assert worker.pulled.tolist() == [5.0, 6.0, 7.0]


@pytest.mark.parametrize("case", ["pulled is global", "stopped", "training"])
def test_rank_zero_validates_the_global_model_without_a_copy_when_it_can(case: str) -> None:
    """Inside ``global_model()`` the module holds the global model, outside its own. No model-sized host buffer
    is made when the worker's pulled model is the global one (DiLoCo between outer steps: the two are swapped),
    nor once the worker was told to stop (its pulled model's buffer holds the module's own; steps it would still
    take are then not pushed); while it trains on a stale pull, the module's own model waits in a new one."""
    from lightning_hdet.asynchronous.exchange import exchange as exchange_module
    from lightning_hdet.asynchronous.exchange.exchange import Exchange

    module = Tiny()
    module.set([1.0, 2.0], 3.0)
    outer = OuterSettings(mode="sync").build(torch.tensor([5.0, 6.0]), torch.tensor([7.0]), workers=1, budget=None)
    ex = object.__new__(Exchange)  # no process groups: only what global_model() reads
    ex.module, ex.device, ex.outer = module, CPU, outer
    network = Network(Fragments([torch.Size([2])]), [1])
    ex.worker = Worker(module, CPU, network.ends[1])
    pulled = [5.0, 6.0, 7.0] if case == "pulled is global" else [5.0, 6.0, 0.0]
    ex.worker.pulled.copy_(torch.tensor(pulled))
    if case == "stopped":
        ex.worker.round_steps = math.inf
    made = []
    real = exchange_module.host_buffer
    with mock.patch.object(exchange_module, "host_buffer", side_effect=lambda *a: made.append(a) or real(*a)):
        with ex.global_model():
            assert module.w.tolist() == [5.0, 6.0] and module.stat.tolist() == [7.0]
    assert module.w.tolist() == [1.0, 2.0] and module.stat.tolist() == [3.0]
    assert len(made) == (1 if case == "training" else 0)
    assert ex.worker.pulled.tolist() == ([1.0, 2.0, 3.0] if case == "stopped" else pulled)
    assert ex.worker.pulled_lent == (case == "stopped")
    if case == "stopped":  # a step after the stop: the leaving push carries no pseudo-gradient
        ex.worker.step()
        ex.worker.exchange(Kind.BYE)
        push, messages = network.server_end.receive()
        assert push.kind == Kind.BYE and push.steps == 0 and list(messages) == []
