"""Issue 43, item 1: a worker keeps training while its exchange travels (``overlap_steps=τ``). The schedule and the
correction by hand; a remote worker (background thread) and rank 0's worker (merging in place from the outer
state) in one process, step by step, with hand-computed models and pushes; the budget with pending steps; then
2-worker fits (gloo, fork) in async mode and DiLoCo over an emulated slow link: the run learns, the budget is
exact, and the link holds the training thread only at the goodbye (blocking: at every exchange, all of it in the
worker's reported waits)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch import nn

from lightning_hdet import AsyncLocalSGDStrategy, SlowLink, SlowRanks, WorkerShape
from lightning_hdet.asynchronous.exchange.overlapped import OverlapWorker, correction, overlap_this_round
from lightning_hdet.asynchronous.exchange.public_model import PublicModel
from lightning_hdet.asynchronous.exchange.server import Server
from lightning_hdet.asynchronous.lightning.worker_shape import check_overlap_steps
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.slow_link import LimitedTransport
from lightning_hdet.asynchronous.wire.transport import WorkerTransport, receive_reply, send_reply
from benchmarks.common import adaptive_rounds
from tests.helpers import async_strategy
from tests.test_async_defaults import SGDBoring, _loss


# ------------------------------------------------------------------------------------------------ pure: the math
@pytest.mark.parametrize(("tau", "allocated", "carried", "expected"), [
    (3, 8, 0, 3),  # a first round: 5 steps, push, 3 overlapped
    (3, 8, 3, 3),  # later rounds carry the previous overlap
    (3, 2, 3, 2),  # a round shorter than τ overlaps whole (its push carries the 3 earlier steps)
    (3, 2, 0, 1),  # ... but a first one keeps a step before its push: a push of 0 steps reads as discarded
    (3, 1, 0, 0),  # no room: a blocking exchange
    (0, 8, 0, 0),
])
def test_overlap_this_round(tau: int, allocated: int, carried: int, expected: int) -> None:
    assert overlap_this_round(tau, allocated, carried) == expected


def test_the_correction_carries_the_overlapped_displacement_onto_the_new_global_model() -> None:
    """θ_global_new = [1, 2], θ_at_send = [0.5, 4], θ_now = [3, 3]: the merge is [1, 2] + ([3, 3] − [0.5, 4]) =
    [3.5, 1]; the correction [0.5, −2] is written into θ_at_send's buffer."""
    at_send, now = torch.tensor([0.5, 4.0]), torch.tensor([3.0, 3.0])
    corr = correction(torch.tensor([1.0, 2.0]), at_send)
    assert corr.data_ptr() == at_send.data_ptr() and corr.tolist() == [0.5, -2.0]
    assert (now + corr).tolist() == [3.5, 1.0]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"overlap_steps": -1}, r"`overlap_steps` must be an integer >= 0, got -1"),
    ({"overlap_steps": 1.5}, r"`overlap_steps` must be an integer >= 0, got 1.5"),
    ({"overlap_steps": 8, "local_steps": 8}, r"`overlap_steps=8` leaves no step of a round before its push .*"
                                             r"allowed: 0 \(a blocking exchange\) or 1..7"),
    ({"overlap_steps": 2, "ranks_per_worker": 2}, r"`overlap_steps=2` is not supported with `ranks_per_worker=2`"),
])
def test_bad_overlap_steps_are_refused_before_any_process_group(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        async_strategy(**{"local_steps": 8, **kwargs})
    check_overlap_steps(0, 1, 4)  # 0 is always allowed


# ------------------------------------------------------------------------------- the budget with pending steps
def _outer(mode: str, budget: int, **kwargs):
    settings = OuterSettings(mode=mode, local_steps=kwargs.pop("local_steps", 8), check_pushes=False, outer=DelayedNesterov(lr=1.0, momentum=0.0), **kwargs)
    return settings.build(torch.zeros(2), torch.zeros(0), workers=2, budget=budget)


def _push(worker: int, steps: int, pending: int = 0, kind: Kind = Kind.PUSH) -> Push:
    push = Push.of(worker, WorkerHeader(kind, steps, 1.0, 0.0, 0, pending))
    push.pseudo_gradient = torch.zeros(2) if steps else None
    return push


def test_diloco_keeps_the_pending_steps_out_of_the_budget_left() -> None:
    """Budget 40, H = 8, τ = 3. Round 1: each pushes 5 steps with 3 pending: done 10, pending 6, each gets
    min(8, (40 − 10 − 6) // 2) = 8. Round 2: pushes of 8 (3 carried + 5), 3 pending: done 26, each gets
    (40 − 26 − 6) // 2 = 4. Round 3: pushes of 3 + 1, 3 pending: done 34, (40 − 34 − 6) // 2 = 0: stop, and the
    goodbyes carry the last 3 each: 40, the budget exactly."""
    outer = _outer("sync", 40)
    outer.process([_push(0, 0, kind=Kind.HELLO), _push(1, 0, kind=Kind.HELLO)])
    assert outer.process([_push(0, 5, 3), _push(1, 5, 3)]) == {0: 8, 1: 8}
    assert outer.process([_push(0, 8, 3), _push(1, 8, 3)]) == {0: 4, 1: 4}
    assert outer.process([_push(0, 4, 3), _push(1, 4, 3)]) == {0: 0, 1: 0}
    outer.process([_push(0, 3, kind=Kind.BYE), _push(1, 3, kind=Kind.BYE)])
    assert outer.steps_done == 40 and outer.pending_steps == 0


def test_async_keeps_every_workers_pending_steps_out_of_the_budget_left() -> None:
    """Budget 30, H = 8 (no dynamic lengths). Both say hello (8 steps each in flight). Worker 0 pushes 5 with 3
    pending: it gets min(8, 30 − 5 − 8 (worker 1's) − 3 (its own pending)) = 8. Worker 1 pushes 5 with 3 pending:
    min(8, 30 − 10 − 8 − 6) = 6. A rejected push frees its pending steps."""
    outer = _outer("async", 30, local_steps=8)
    outer.process([_push(0, 0, kind=Kind.HELLO)])
    outer.process([_push(1, 0, kind=Kind.HELLO)])
    assert outer.process([_push(0, 5, 3)]) == {0: 8}
    assert outer.process([_push(1, 5, 3)]) == {1: 6}
    assert outer.pending_steps == 6
    outer.process([_push(1, 0, 3)])  # a round worker 1 discarded itself: rejected, its overlap dropped too
    assert outer.pending_steps == 3


# ----------------------------------------------------------------------- one process: the worker, step by step
#: The model on each device there is (pinned host buffers and the device copies with CUDA).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


class Scripted(WorkerTransport):
    """A remote worker's transport: records each push (header, pseudo-gradient) and answers with the next of
    ``replies`` (a round length and the global model)."""

    def __init__(self, replies: list[tuple[int, list[float]]]) -> None:
        self.replies, self.pushes = list(replies), []
        self.layout = Fragments([torch.Size([2])])

    def push(self, header, messages, buffers, inner_state) -> None:
        gradient = [v.clone() for v in self.layout.decode(messages, torch.empty(2))]
        self.pushes.append((header.steps, header.pending, torch.cat(gradient).tolist() if gradient else None))

    def pull(self, into):
        steps, model = self.replies.pop(0)
        if steps:
            into.copy_(torch.tensor(model))
        return ServerHeader(steps, len(self.pushes))


def _train(worker: OverlapWorker, module: Pair, steps: int) -> list[bool]:
    """``steps`` inner steps of +1 on every value, each counted by the worker (exchanging when it says)."""
    due = []
    for _ in range(steps):
        with torch.no_grad():
            module.w.add_(1.0)
        due.append(worker.step())
        if due[-1]:
            worker.exchange(Kind.PUSH)
    return due


@pytest.mark.parametrize("device", DEVICES)
def test_a_remote_worker_pushes_early_trains_on_and_carries_its_overlapped_steps_onto_the_reply(device: str) -> None:
    """H = 4, τ = 2, each step +1. Hello: global [0, 0]. 2 steps ([2, 2]), push Δ = [−2, −2] (2 steps, 2 pending);
    the reply [5, 5] lands while 2 more steps run ([4, 4]); merge: [5, 5] + ([4, 4] − [2, 2]) = [7, 7], the
    reference [5, 5]. 2 steps ([9, 9]), push Δ = [5, 5] − [9, 9] (2 carried + 2 steps, 2 pending); the reply says
    stop while 2 more steps run ([11, 11]); the goodbye pushes those 2 against θ_at_send [9, 9]. Pushed: 2 + 4 + 2,
    the two rounds' 8 steps."""
    module, transport = Pair().to(device), Scripted([(4, [0.0, 0.0]), (4, [5.0, 5.0]), (0, [])])
    worker = OverlapWorker(module, torch.device(device), transport, overlap_steps=2)
    worker.exchange(Kind.HELLO)
    assert _train(worker, module, 4) == [False, True, False, True]
    assert module.w.tolist() == [7.0, 7.0] and worker.pulled.tolist() == [5.0, 5.0] and worker.steps_in_round == 2
    assert _train(worker, module, 4) == [False, True, False, True] and worker.stopped
    assert module.w.tolist() == [11.0, 11.0]
    worker.exchange(Kind.BYE)
    assert transport.pushes == [(0, 0, None), (2, 2, [-2.0, -2.0]), (4, 2, [-4.0, -4.0]), (2, 0, [-2.0, -2.0])]
    assert [r[0] for r in worker.rounds] == [4, 4, 0]


class Changes(WorkerTransport):
    """A remote worker's transport with int8 pulls over the real wire code: before each pull rank 0's public model
    is published toward the next global model of ``models``; the reply carries the changes the worker lacks."""

    def __init__(self, models: list[list[float]], steps: list[int]) -> None:
        self.layout = Fragments([torch.Size([2])], pull_compression="int8")
        self.public = PublicModel(torch.zeros(2), self.layout)
        self.models, self.steps, self.deltas = list(models), list(steps), []

    def push(self, header, messages, buffers, inner_state) -> None:
        for _ in messages:
            pass

    def pull(self, into):
        steps, version = self.steps.pop(0), len(self.steps)
        self.public.publish(torch.tensor(self.models.pop(0)), source_version=version)
        deltas, messages = self.public.reply(1) if steps else (-1, [])
        wire: list[torch.Tensor] = []
        send_reply(lambda t: wire.append(t.clone()), ServerHeader(steps, version, 0, deltas), messages, torch.zeros(0))
        it = iter(wire)
        header = receive_reply(lambda t: t.copy_(next(it)), self.layout, into, self.layout.pull_buffer())
        self.deltas.append(header.deltas)
        return header


def test_an_overlapped_worker_adds_int8_changes_to_the_model_it_pulled_not_to_the_one_it_sent() -> None:
    """H = 4, τ = 2, each step +1, int8 pulls. The hello sends the model itself, [0, 0]. 2 steps ([2, 2]), push;
    while 2 more steps run ([4, 4]) the reply brings one change, [5, 5] (exact in int8: 127 levels of 5 / 127), added
    to the pulled [0, 0] (not to θ_at_send [2, 2], which the worker keeps apart): merge [5, 5] + ([4, 4] − [2, 2]) =
    [7, 7], the reference [5, 5]."""
    module, transport = Pair(), Changes([[0.0, 0.0], [5.0, 5.0], [5.0, 5.0]], [4, 4, 0])
    worker = OverlapWorker(module, torch.device("cpu"), transport, layout=transport.layout, overlap_steps=2)
    worker.exchange(Kind.HELLO)
    _train(worker, module, 4)
    assert transport.deltas == [-1, 1]
    torch.testing.assert_close(worker.pulled, torch.tensor([5.0, 5.0]))
    torch.testing.assert_close(module.w.detach(), torch.tensor([7.0, 7.0]))


@pytest.mark.parametrize("pull", ["none", "bf16"])  # bf16: decoded piece by piece (these values are exact in it)
@pytest.mark.parametrize("device", DEVICES)
def test_rank_0_merges_in_place_from_the_outer_state_in_diloco(device: str, pull: str) -> None:
    """One worker, DiLoCo, outer lr 0.5 without momentum, H = 4, τ = 2, each step +1. 2 steps ([2, 2]), push Δ =
    [−2, −2]: the global model becomes [0, 0] + 0.5 · [2, 2] = [1, 1]. 2 steps ([4, 4]); merge: [1, 1] + ([4, 4] −
    [2, 2]) = [3, 3], the reference [1, 1] (in the pulled buffer, which held θ_at_send [2, 2] meanwhile). 2 steps
    ([5, 5]), push Δ = [1, 1] − [5, 5] (4 steps): global [3, 3]. 2 steps ([7, 7]); merge: [3, 3] + ([7, 7] − [5, 5])
    = [5, 5]. The goodbye pushes the 2 carried steps, [3, 3] − [5, 5]: global [4, 4]; 2 + 4 + 2 steps applied."""
    module = Pair().to(device)
    outer = OuterSettings(mode="sync", local_steps=4, check_pushes=False, outer=DelayedNesterov(lr=0.5, momentum=0.0)).build(
        torch.zeros(2), torch.zeros(0), workers=1, budget=None)
    layout = Fragments([torch.Size([2])], pull_compression=pull)
    server = Server(outer, 1, None, timeout=10.0, layout=layout)
    server.start()
    worker = OverlapWorker(module, torch.device(device), server.local, layout=layout, overlap_steps=2)
    assert worker.in_place and worker.sent.numel() == 0  # no model-sized copy on rank 0
    worker.exchange(Kind.HELLO)
    _train(worker, module, 2)
    assert worker.pulled.tolist() == [2.0, 2.0]  # θ_at_send, kept in the pulled buffer while the exchange travels
    _train(worker, module, 2)
    assert outer.params.tolist() == [1.0, 1.0]
    assert module.w.tolist() == [3.0, 3.0] and worker.pulled.tolist() == [1.0, 1.0]
    _train(worker, module, 4)
    assert module.w.tolist() == [5.0, 5.0] and outer.params.tolist() == [3.0, 3.0]
    worker.exchange(Kind.BYE)
    server.join()
    assert outer.params.tolist() == [4.0, 4.0] and outer.steps_done == 8


# ---------------------------------------------------------------------------------- 2 workers over a slow link
class Record(Callback):
    """Rank 0 writes the run's result; rank 1 (behind the link) which threads the link held: each of its waits is
    recorded with the name of the thread it held (the exchange's background thread, or the training thread)."""

    def __init__(self, out: Path) -> None:
        self.out, self.held = out, {}

    def _held(self, seconds: float) -> None:
        self.held.setdefault(threading.current_thread().name, []).append(seconds)
        time.sleep(seconds)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        transport = trainer.strategy._exchange.worker.transport
        if isinstance(transport, LimitedTransport):  # installed by SlowLink (listed before this callback)
            transport.sleep = self._held

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 1:
            (self.out.parent / f"{self.out.stem}_held.json").write_text(json.dumps(self.held))
        if trainer.global_rank == 0:
            result = trainer.strategy.result
            self.out.write_text(json.dumps({"loss": _loss(pl_module), "steps_done": result.steps_done,
                                            "budget": result.budget,
                                            "wait": {w: r.total_wait_s for w, r in result.workers.items()},
                                            "steps": {w: r.steps for w, r in result.workers.items()}}))


def _fit(tmp_path: Path, mode: str, overlap: int) -> dict:
    """BoringModel + SGD, 2 workers, H = 8, 20 ms steps, a link of 1 Mbit/s and 50 ms each way (a push and a pull
    of its 66 parameters: about 105 ms), 240 steps of budget; with τ = 6 (120 ms of steps) the link is hidden."""
    seed_everything(0)
    out = tmp_path / f"{mode}{overlap}.json"
    Trainer(strategy=AsyncLocalSGDStrategy(local_steps=adaptive_rounds(8, mode), mode=mode, start_method="fork", worker=WorkerShape(overlap_steps=overlap)),
            accelerator="cpu", devices=2, max_steps=120, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[SlowRanks({}, base_seconds=0.02), SlowLink(bits_per_s=1e6, latency_s=0.05),
                       Record(out)]).fit(SGDBoring())
    return {**json.loads(out.read_text()), "held": json.loads((tmp_path / f"{mode}{overlap}_held.json").read_text())}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_overlap_learns_keeps_the_budget_and_the_link_no_longer_holds_the_worker(tmp_path: Path, mode: str) -> None:
    seed_everything(0)
    initial = _loss(SGDBoring())
    blocking, overlapped = _fit(tmp_path, mode, 0), _fit(tmp_path, mode, 6)
    for run in (blocking, overlapped):
        assert run["steps_done"] == run["budget"] == 240
    # Blocking, the link holds the training thread at every push and pull, and the worker's reported waits contain
    # all of it but the goodbye's push (a 56-byte header: 0.05 + 448e-6 s; no wait is reported after it).
    # Overlapped, the link holds the exchange thread instead, and the training thread only for the goodbye's push,
    # which carries the last τ steps (a header and 66 float32 values, 320 bytes: 0.05 + 2560e-6 s). Seconds of the
    # link itself, from the bytes: these do not depend on the machine's load, unlike the waits' own seconds (which
    # fell, overlapped, in every run at a normal load, and not always with 20-40 processes on 2 cores).
    assert set(blocking["held"]) == {"MainThread"} and len(blocking["held"]["MainThread"]) >= 4
    assert blocking["wait"]["1"] >= sum(blocking["held"]["MainThread"]) - (0.05 + 448e-6) - 1e-9
    assert overlapped["held"]["MainThread"] == pytest.approx([0.05 + 2560e-6])
    assert len(overlapped["held"]["async-local-sgd-exchange"]) >= 4
    # learns: 15 rounds per worker, 6 of each round's 8 steps overlapped; at the default outer lr 0.163 (issue 42's
    # elastic fix) DiLoCo ends at 0.14 x the start (deterministic), async below 0.1 x; at 0.339 both below 0.1 x
    assert overlapped["loss"] < 0.25 * initial
    if mode == "sync":
        assert overlapped["steps"]["0"] == overlapped["steps"]["1"] == 120
