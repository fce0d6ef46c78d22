"""Issue 43, staggered fragments (``stagger=F``, Streaming DiLoCo's schedule): the layout's parts and the outer step
of a part by hand; an overlapping worker pushing its parts in turn, step by step, with hand-computed models and
pushes; the options refused (also stagger with outer="sparseloco", and in Fabric); then a 2-worker DiLoCo fit
(gloo, fork): it learns and the budget is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch import nn

from lightning_hdet import AsyncLocalSGDStrategy, WorkerShape
from lightning_hdet.asynchronous.exchange.overlapped import OverlapWorker
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.sparseloco import SparseLoCo
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import TopK
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport
from lightning_hdet.fabric import AsyncLocalSGDFabricStrategy
from tests.helpers import async_strategy
from tests.test_async_defaults import SGDBoring, _loss


# ------------------------------------------------------------------------------------------- pure: the layout
def test_a_staggered_layout_cuts_the_model_into_parts_of_consecutive_fragments() -> None:
    """A (3, 2) and a (10,) tensor, 16 values, 2 parts: fragments of at most a quarter of a part, 16 / 8 = 2 values
    (a row of the first, a 2-value chunk of the second): 8 fragments. Their middles 1, 3, ..., 15 fall in the
    first half (0..8) for the first 4: parts [0..4) and [4..8), values [0, 8) and [8, 16), 32 float32 bytes each."""
    layout = Fragments([torch.Size([3, 2]), torch.Size([10])], parts=2)
    assert layout.ranges == [(s, s + 2) for s in range(0, 16, 2)]
    assert layout.parts == [range(0, 4), range(4, 8)]
    assert (layout.span(0), layout.span(1), layout.span()) == ((0, 8), (8, 16), (0, 16))
    assert layout.part_nbytes(1) == layout.reply_nbytes(-1, 1) == 32 and layout.nbytes == 64
    flat = torch.arange(16.0)
    assert [v.tolist() for v in layout.split(flat, 1)] == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert Fragments([torch.Size([3, 2]), torch.Size([10])]).parts == [range(0, 1)]  # unstaggered: one fragment


def test_a_part_without_a_fragment_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`stagger=2` leaves a part of this model without parameters .* 1 fragment"):
        Fragments([torch.Size([1, 10])], parts=2)  # one row: one fragment


# ------------------------------------------------------------------------------------- pure: the outer side
def _part_push(worker: int, kind: Kind, steps: int, part: int) -> Push:
    return Push.of(worker, WorkerHeader(kind, steps, 1.0, 0.0, 0, 0, part))


@pytest.mark.parametrize("checked", [False, True])
def test_each_fragment_steps_with_the_mean_of_the_pushes_that_carried_it(checked: bool) -> None:
    """The layout above, DiLoCo, H = 4, F = 2, outer lr 1 without momentum, budget 12. Hellos: rounds of H / F = 2.
    Both push part 0 (2 steps each), all 2 and all 4: its 4 fragments step by the mean 3, θ[0:8] = −3, θ[8:16]
    stays 0; done 4, rounds of min(2, (12 − 4) // 2) = 2. Then worker 0 leaves (its goodbye carries every part, all
    1) while worker 1 pushes part 1 (all 3): part 0's fragments take worker 0's alone, θ[0:8] = −4; part 1's the
    mean 2, θ[8:16] = −2."""
    layout = Fragments([torch.Size([3, 2]), torch.Size([10])], parts=2)
    outer = OuterSettings(mode="sync", local_steps=4, stagger=2, check_pushes=checked, outer=DelayedNesterov(lr=1.0,
                          momentum=0.0)).build(torch.zeros(16), torch.zeros(0), workers=2, budget=12,
                                                    ranges=layout.ranges, parts=layout.parts)

    def batch(*pushes: tuple[Push, float]) -> dict[int, int]:
        for push, value in pushes:
            fragments = [torch.full((2,), value) for _ in layout.indices(push.part)] if push.steps else []  # hello
            outer.receive(push, fragments, stable=True)
        return outer.close([push for push, _ in pushes])

    assert batch((_part_push(0, Kind.HELLO, 0, -1), 0.0), (_part_push(1, Kind.HELLO, 0, -1), 0.0)) == {0: 2, 1: 2}
    assert batch((_part_push(0, Kind.PUSH, 2, 0), 2.0), (_part_push(1, Kind.PUSH, 2, 0), 4.0)) == {0: 2, 1: 2}
    assert outer.params.tolist() == [-3.0] * 8 + [0.0] * 8 and outer.outer_updates == 1
    assert batch((_part_push(0, Kind.BYE, 2, -1), 1.0), (_part_push(1, Kind.PUSH, 2, 1), 3.0)) == {1: 2}
    assert outer.params.tolist() == [-4.0] * 8 + [-2.0] * 8 and outer.steps_done == 8


# ------------------------------------------------------------------------ one process: the worker, step by step
class Quad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4))


class Parts(WorkerTransport):
    """A remote worker's transport: records each push (header, part, pseudo-gradient) and answers with the next of
    ``replies`` (a round length and the values of the part pushed)."""

    def __init__(self, layout: Fragments, replies: list[tuple[int, list[float]]]) -> None:
        self.layout, self.replies, self.pushes, self.part = layout, list(replies), [], -1

    def push(self, header, messages, buffers, inner_state) -> None:
        values = [v.clone() for v in self.layout.decode(messages, torch.empty(4), header.part)]
        self.part = header.part
        self.pushes.append((header.steps, header.pending, header.part, torch.cat(values).tolist() if values else None))

    def pull(self, into):
        steps, model = self.replies.pop(0)
        start, end = self.layout.span(self.part)
        if steps:
            into[start:end].copy_(torch.tensor(model))
        return ServerHeader(steps, len(self.pushes), part=self.part)


def test_a_staggered_worker_pushes_its_parts_in_turn_and_merges_only_the_part_that_travelled() -> None:
    """4 values in 4 fragments, parts [0, 2) and [2, 4); rounds of 4, τ = 2, each step +1. Hello: [0, 0, 0, 0].
    2 steps ([2, 2, 2, 2]), push part 0: Δ = [−2, −2]; the reply [5, 5] lands while 2 more steps run ([4, 4, 4, 4]);
    merge part 0 only: [5, 5] + ([4, 4] − [2, 2]) = [7, 7], part 1 trains on: [7, 7, 4, 4]. 2 steps ([9, 9, 6, 6]),
    push part 1: Δ = [0, 0] − [6, 6], its 6 steps since the hello (the push counts 2 carried + 2); the reply says
    stop while 2 more steps run ([11, 11, 8, 8]); the goodbye carries every part, against [5, 5] (part 0's new
    reference) and [6, 6] (part 1's θ_at_send): [−6, −6, −2, −2]."""
    module, layout = Quad(), Fragments([torch.Size([4])], max_bytes=8, parts=2)
    assert layout.parts == [range(0, 2), range(2, 4)]
    transport = Parts(layout, [(4, [0.0] * 4), (4, [5.0, 5.0]), (0, [])])
    worker = OverlapWorker(module, torch.device("cpu"), transport, layout=layout, overlap_steps=2)
    worker.exchange(Kind.HELLO)
    for expected in ([7.0, 7.0, 4.0, 4.0], [11.0, 11.0, 8.0, 8.0]):
        for _ in range(4):
            with torch.no_grad():
                module.w.add_(1.0)
            if worker.step():
                worker.exchange(Kind.PUSH)
        assert module.w.tolist() == expected
    assert worker.stopped
    worker.exchange(Kind.BYE)
    assert transport.pushes == [(0, 0, -1, None), (2, 2, 0, [-2.0, -2.0]), (4, 2, 1, [-6.0, -6.0]),
                                (2, 0, -1, [-6.0, -6.0, -2.0, -2.0])]


# ----------------------------------------------------------------------------------------------- the options
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"stagger": 0}, r"`stagger` must be a positive integer, got 0"),
    ({"stagger": 2}, r"`stagger=2` needs `overlap_steps` >= 1, got overlap_steps=0"),
    ({"stagger": 2, "overlap_steps": 1, "mode": "async"}, r"`stagger=2` applies to DiLoCo only \(mode='sync'\), got mode='async'"),
    ({"stagger": 3, "overlap_steps": 1}, r"`stagger=3` does not divide local_steps=8: .* Allowed: \[1, 2, 4, 8\]"),
    ({"stagger": 2, "overlap_steps": 1, "pull_compression": "int8"}, r"`stagger=2` is not supported with `pull_compression=Int8\(chunk=256\)`"),
    ({"stagger": 2, "overlap_steps": 4}, r"`overlap_steps=4` leaves no step of a round before its push "
                                         r"\(local_steps=8 / stagger=2\); allowed: 0 \(a blocking exchange\) or 1..3"),
    ({"stagger": 2, "overlap_steps": 1, "outer": "sparseloco", "compression": "topk2"},
     r"`stagger` must be 1 with SparseLoCo, got 2. .* one part of the model."),
    ({"stagger": 2, "overlap_steps": 1, "outer": "sparseloco", "compression": "topk2", "pull_compression": "topk2"},
     r"`stagger` must be 1 with SparseLoCo, got 2"),
])
def test_bad_stagger_is_refused_before_any_process_group(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        async_strategy(**{"local_steps": 8, "mode": "sync", **kwargs})
    assert AsyncLocalSGDStrategy(local_steps=8, mode="sync", worker=WorkerShape(stagger=4, overlap_steps=1)).config["stagger"] == 4


def test_fabric_refuses_stagger_and_checks_its_options_as_the_trainer_does() -> None:
    """Fabric runs no overlapped exchange, which staggered parts travel in; stagger with outer="sparseloco" is
    refused there for the same reason as with the Trainer; SparseLoCo's options still reach its exchange."""
    with pytest.raises(ValueError, match=r"`stagger=2` is not supported by AsyncLocalSGDFabricStrategy: .*overlap"):
        AsyncLocalSGDFabricStrategy(local_steps=8, mode="sync", stagger=2)
    with pytest.raises(ValueError, match=r"`stagger` must be 1 with SparseLoCo, got 2"):
        AsyncLocalSGDFabricStrategy(local_steps=8, mode="sync", stagger=2, outer="sparseloco", compression="topk2")
    strategy = AsyncLocalSGDFabricStrategy(local_steps=8, mode="sync", outer="sparseloco", compression="topk2",
                                           pull_compression="topk2")
    assert strategy._codecs == {"compression": TopK(bits=2), "pull_compression": TopK(bits=2), "error_feedback": True,
                                "outer_optimizer": SparseLoCo(lr=1.0, error_decay=0.95)}


# --------------------------------------------------------------------------------------- 2 workers, DiLoCo
class Record(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            result = trainer.strategy.result
            self.out.write_text(json.dumps({"loss": _loss(pl_module), "steps_done": result.steps_done,
                                            "budget": result.budget, "updates": result.outer_updates,
                                            "steps": {w: r.steps for w, r in result.workers.items()}}))


@pytest.mark.timeout(120)
def test_staggered_diloco_learns_and_keeps_the_budget(tmp_path: Path) -> None:
    """BoringModel (a 2 x 32 weight and 2 biases: 3 fragments, parts [weight row 0], [row 1, bias]) + SGD, 2
    workers, H = 8, F = 2, τ = 3: rounds of 4, 120 steps each: 30 rounds, each an outer update of one part. Learns as
    DiLoCo without stagger does here (0.14 x the start, tests/test_overlap.py): below 0.25 x."""
    seed_everything(0)
    initial, out = _loss(SGDBoring()), tmp_path / "run.json"
    Trainer(strategy=AsyncLocalSGDStrategy(local_steps=8, mode="sync", start_method="fork", worker=WorkerShape(stagger=2, overlap_steps=3)),
            accelerator="cpu", devices=2, max_steps=120, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path, callbacks=[Record(out)]).fit(SGDBoring())
    run = json.loads(out.read_text())
    assert run["steps_done"] == run["budget"] == 240 and run["steps"] == {"0": 120, "1": 120}
    assert run["updates"] >= 30
    assert run["loss"] < 0.25 * initial


def test_rank_0_staggered_restarts_every_part_from_its_reference_after_a_rejected_round() -> None:
    """Rank 0's in-process worker, parts [0, 2) and [2, 4), rounds of 4, τ = 2, each step +1. Hello: [0, 0, 0, 0].
    2 steps, push part 0, 2 more steps ([4, 4, 4, 4]); the reply rejects the round and brings part 0's global values
    [0, 0]. No trace of the rejected round may stay: part 0 is the global [0, 0], and part 1 goes back to its
    reference [0, 0] (a remote worker writes its whole pulled model); keeping [4, 4] there would push the bad round's
    steps again."""
    from lightning_hdet.asynchronous.wire.transport import InProcessTransport

    module, layout = Quad(), Fragments([torch.Size([4])], max_bytes=8, parts=2)
    pushes: list[int] = []

    def accept(push, messages) -> None:
        for _ in messages:
            pass
        pushes.append(push.part)
        transport.reply(ServerHeader(4, len(pushes), 1 if push.kind == Kind.PUSH else 0, part=push.part))

    def read_model(worker, into, pieces, part) -> int:
        start, end = layout.span(part) if part >= 0 else (0, 4)
        values = torch.zeros(end - start)
        if pieces is None:
            into[start:end].copy_(values)
        else:
            pieces(start, values)
        return len(pushes)

    transport = InProcessTransport(accept, read_model, timeout=5.0, check=lambda: None)
    worker = OverlapWorker(module, torch.device("cpu"), transport, layout=layout, overlap_steps=2)
    worker.exchange(Kind.HELLO)
    for _ in range(4):
        with torch.no_grad():
            module.w.add_(1.0)
        if worker.step():
            worker.exchange(Kind.PUSH)
    assert pushes == [-1, 0] and worker.rejected == 1
    assert module.w.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_resuming_with_another_stagger_is_refused_with_its_reason() -> None:
    """The outer optimizer holds one parameter per fragment: 16 values in parts of 2 make 8 fragments of 2, one part
    makes 1; loading one's state into the other names the layout, not torch's parameter-group mismatch."""
    def outer(stagger: int):
        layout = Fragments([torch.Size([16])], parts=stagger)
        return OuterSettings(mode="sync", local_steps=4, stagger=stagger, outer=DelayedNesterov(lr=1.0,
                             momentum=0.0)).build(torch.zeros(16), torch.zeros(0), workers=2, budget=12,
                                                       ranges=layout.ranges, parts=layout.parts)

    staggered, whole = outer(2), outer(1)
    with pytest.raises(ValueError, match=r"holds \d+ fragment\(s\), this run 1: .*another `stagger`"):
        whole.load_state_dict(staggered.state_dict())
