"""SparseLoCo: the decayed error feedback, the round change (encode, decode, the outer step), and the
exact sparse pulls, in one process. Values are computed by hand in the comments."""

from __future__ import annotations

import pytest
import torch

from lightning_hdet.asynchronous.exchange.public_model import PublicModel
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.outer.sparseloco import RoundCodec, SparseLoCo, SparseRound
from lightning_hdet.asynchronous.outer.sparseloco import SparseSyncStep
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import ErrorFeedback, Int8, TopK
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push, ServerHeader
from lightning_hdet.asynchronous.wire.transport import receive_reply, send_reply
from tests.test_async_exchange import CPU, _one_round_each, _start

TWO = [torch.Size([2])]


def _read_back(wire: list[torch.Tensor], layout: Fragments, into: torch.Tensor, own=None) -> None:
    """A reply's tensors, as sent, received by the workers' code into ``into`` (all of them)."""
    pieces = iter(wire)
    receive_reply(lambda t: t.copy_(next(pieces)), layout, into, layout.pull_buffer(), own=own)
    assert next(pieces, None) is None


def _message(values: list[float]) -> torch.Tensor:
    """A topk2 push of two values: one kept (the larger), its level exact when it is the chunk's largest."""
    return TopK(bits=2).bind(TWO).encode(torch.tensor(values))


def test_error_feedback_decay_weights_the_residual_in_the_next_push() -> None:
    """topk2 keeps one value of two. beta = 0.5. Push 1: g = [4, 1] sends [4, 0], keeps residual [0, 1]. Push 2:
    g = [1, 2] plus 0.5 * [0, 1] = [1, 2.5] sends [0, 2.5], keeps [1, 0]. (Plain error feedback would send 3.)"""
    codec = TopK(bits=2).bind(TWO)
    feedback = ErrorFeedback(codec, decay=0.5)
    assert codec.decode(feedback.encode(torch.tensor([4.0, 1.0]))).tolist() == [4.0, 0.0]
    assert feedback.residual.tolist() == [0.0, 1.0]
    assert codec.decode(feedback.encode(torch.tensor([1.0, 2.0]))).tolist() == [0.0, 2.5]
    assert feedback.residual.tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"`error_decay` must be a number in \[0, 1\], got 1.5"):
        ErrorFeedback(codec, decay=1.5)


def test_a_round_change_forwards_the_pushes_and_decodes_to_minus_lr_times_their_mean() -> None:
    """Three slots of a 7-byte topk2 message (a scale, a position, a level byte) padded to 8, after the 4-byte
    factor: 28 bytes. Workers 0 and 2 push [4, 0] and [0, -3]; worker 1's push was rejected (its slot is zeros).
    lr 1, 2 pushes: factor -0.5, so the change is -0.5 * [4, -3] = [-2, 1.5]; the slots are empty afterwards."""
    sparse_round = SparseRound([TopK(bits=2).bind(TWO)], workers=3)
    codec = sparse_round.codecs[0]
    assert (codec.slot_bytes, codec.nbytes) == (8, 28)
    for worker, values in ((0, [4.0, 1.0]), (1, [5.0, 5.0]), (2, [0.0, -3.0])):
        assert list(sparse_round.keeping(worker, [_message(values)]))  # passed on as they came
    sparse_round.drop(1)
    (change,) = sparse_round.close(pushes=2, lr=1.0)
    assert torch.equal(codec.slot(change, 1), torch.zeros(7, dtype=torch.uint8))
    assert change[:4].view(torch.float32).tolist() == [-0.5]
    assert codec.decode(change, torch.empty(2)).tolist() == [-2.0, 1.5]
    (empty,) = sparse_round.close(pushes=1, lr=1.0)
    assert codec.decode(empty, torch.empty(2)).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"forwards sparse pushes; the pushes' codec is Int8\(chunk=256\)"):
        RoundCodec(Int8().bind(TWO), workers=2)


def test_the_sparseloco_step_moves_the_global_model_by_the_change_alone() -> None:
    """No momentum, lr 2: G = [1, 1] - 2 * mean([4, 0], [0, -3]) = [1, 1] - [4, -3] = [-3, 4]; a second round
    with the same pushes moves it by as much again (a momentum would move it further): [-7, 7]."""
    outer = OuterSettings(mode="sync", outer=SparseLoCo(lr=2.0), check_pushes=False).build(
        torch.ones(2), torch.zeros(0), workers=2, budget=None)
    policy = outer.step_policy
    assert isinstance(policy, SparseSyncStep)
    sparse_round = SparseRound([TopK(bits=2).bind(TWO)], workers=2)
    policy.attach(sparse_round)
    for expected in ([-3.0, 4.0], [-7.0, 7.0]):
        for worker, values in ((0, [4.0, 1.0]), (1, [0.0, -3.0])):
            messages = list(sparse_round.keeping(worker, [_message(values)]))
            outer.receive(Push(worker, Kind.PUSH, 1, 0.0, 0.0), Fragments(TWO, "topk2").decode(messages, torch.empty(2)))
        outer.close([Push(0, Kind.PUSH, 1, 0.0, 0.0), Push(1, Kind.PUSH, 1, 0.0, 0.0)])
        assert outer.params.tolist() == expected
    assert outer.outer_updates == 2 and not outer.optimizer.state  # no momentum buffer


def test_the_public_model_follows_random_round_changes_bit_for_bit() -> None:
    """Values that do not add exactly in float32 (random, three fragments of a 10,000-value model, 4 workers, lr
    0.7): after 5 rounds the public model, moved by the logged changes, equals the global model moved by the outer
    step, bit for bit; so does a worker's copy that adds the changes as rank 0 logged them, and one that adds them as
    they travel to worker 1, without its slot, which it fills with the push it sent."""
    generator = torch.Generator().manual_seed(0)
    shapes = [torch.Size([5000]), torch.Size([3000]), torch.Size([2000])]
    layout = Fragments(shapes, "topk2", max_bytes=4 * 5000, pull_compression="topk2", forward=SparseLoCo().forward(4))
    outer = OuterSettings(mode="sync", outer=SparseLoCo(lr=0.7), check_pushes=False).build(
        torch.randn(10_000, generator=generator), torch.zeros(0), workers=4, budget=None, ranges=layout.ranges)
    sparse_round = SparseRound(layout.codecs, workers=4)
    outer.step_policy.attach(sparse_round)  # type: ignore[attr-defined]
    public = PublicModel(outer.params, layout)
    public.reply(1)  # worker 1 holds version 0: P itself
    copy, pulled = outer.params.clone(), outer.params.clone()
    sent: dict[int, list[torch.Tensor]] = {}
    for version in range(1, 6):
        pushes = [Push(w, Kind.PUSH, 1, 0.0, 0.0) for w in range(4)]
        for push in pushes:
            messages = list(sparse_round.keeping(push.worker, layout.encode(torch.randn(10_000, generator=generator))))
            outer.receive(push, layout.decode(messages, torch.empty(layout.largest)))
            sent[push.worker] = messages
        outer.close(pushes)
        public.publish(outer.params, version, sparse_round.change)
        deltas, changes = public.reply(1)
        for (start, end), codec, message in zip(layout.ranges, layout.delta_codecs, changes):
            copy[start:end].add_(codec.decode(message, torch.empty(end - start)))
        wire: list[torch.Tensor] = []
        send_reply(wire.append, ServerHeader(1, version, 0, deltas), layout.without_own(changes, 1), torch.zeros(0))
        _read_back(wire, layout, pulled, own=(1, sent[1]))
        assert deltas == 1 and torch.equal(public.params, outer.params) and torch.equal(copy, outer.params)
        assert torch.equal(pulled, outer.params)
    assert public.change_nbytes == sum(4 + 4 * c.slot_bytes for c in layout.delta_codecs)  # type: ignore[union-attr]


def test_a_pull_leaves_out_the_receivers_slot_which_it_fills_with_its_own_push() -> None:
    """W = 3, one fragment of 2 values, topk2 (7-byte messages in 8-byte slots after the 4-byte factor): a change is
    4 + 3 * 8 = 28 bytes; a pull to a worker whose push was applied leaves its slot out: 20 bytes, in pieces around
    it (worker 0: 4 + 16, worker 1: 12 + 8, worker 2: 20). The pushes send [4, 0], [0, 5] and [0, -3]; lr 1.5 over
    3 pushes: factor -0.5, so each worker, its own push filled in, adds -0.5 * [4, 2] = [-2, -1]. A worker whose
    push was rejected (its streak is 1) gets the whole change."""
    layout = Fragments(TWO, "topk2", pull_compression="topk2", forward=SparseLoCo().forward(3))
    sparse_round = SparseRound(layout.codecs, workers=3)
    pushed = {w: _message(values) for w, values in ((0, [4.0, 1.0]), (1, [1.0, 5.0]), (2, [0.0, -3.0]))}
    for worker, message in pushed.items():
        list(sparse_round.keeping(worker, [message]))
    change = sparse_round.close(pushes=3, lr=1.5)
    assert [layout.reply_nbytes(1, rejected=r) for r in (None, 0, 1)] == [28, 20, 28]
    assert layout.skips_own(1, 0) and not layout.skips_own(1, 1) and not layout.skips_own(0, 0)
    for worker, sizes in ((0, [4, 16]), (1, [12, 8]), (2, [20])):
        wire: list[torch.Tensor] = []
        send_reply(wire.append, ServerHeader(2, 1, 0, 1), layout.without_own(change, worker), torch.zeros(0))
        assert [t.numel() for t in wire[1:]] == sizes
        start = 4 + 8 * worker  # everything but the worker's slot
        assert torch.equal(torch.cat(wire[1:]), torch.cat([change[0][:start], change[0][start + 8 :]]))
        into = torch.zeros(2)
        _read_back(wire, layout, into, own=(worker, [pushed[worker]]))
        assert into.tolist() == [-2.0, -1.0]
    wire = []
    send_reply(wire.append, ServerHeader(2, 1, 1, 1), change, torch.zeros(0))  # rejected: the whole change
    into = torch.zeros(2)
    _read_back(wire, layout, into)
    assert [t.numel() for t in wire[1:]] == [28] and into.tolist() == [-2.0, -1.0]


def test_sparse_pulls_leave_both_workers_with_the_global_model_exactly() -> None:
    """DiLoCo, two workers, topk2 both ways, outer sparseloco (lr 1), error decay 0.5, from [0, 0]. Round 1 leaves
    w = [2, 1] and [3, -4]: g0 = [-2, -1] sends [-2, 0] (keeps [0, -1]), g1 = [-3, 4] sends [0, 4] (keeps [-3, 0]);
    G = -mean = [1, -2], which both workers hold. Worker 1's reply: the hello's model (8 bytes, plus the buffer's 4),
    then one change without its own slot: a 4-byte factor and worker 0's 8-byte slot (plus the buffer): 12 + 16
    bytes (24 with its own slot). (A change of this 2-value model outweighs the model, which the log's bound would
    send instead: the bound is raised here.)"""
    layout = Fragments(TWO, "topk2", pull_compression="topk2", forward=SparseLoCo().forward(2))
    settings = OuterSettings(mode="sync", local_steps=2, outer="sparseloco", check_pushes=False)
    server, network, modules = _start(settings, budget=8, layout=layout)
    assert server.public is not None
    server.public.max_log_bytes = 64
    workers = [Worker(modules[0], CPU, server.local, layout=layout, error_decay=0.5),  # SparseLoCo(error_decay=0.5)
               Worker(modules[1], CPU, network.ends[1], layout=layout, error_decay=0.5)]
    _one_round_each(server, workers, modules, local={0: ([2.0, 1.0], 2.0), 1: ([3.0, -4.0], 6.0)})
    assert server.outer.params.tolist() == [1.0, -2.0]
    assert torch.equal(server.public.params, server.outer.params)
    for worker in workers:
        assert torch.equal(worker.pulled[:2], server.outer.params)
    assert workers[0].feedback.residual.tolist() == [0.0, -1.0]
    assert workers[1].feedback.residual.tolist() == [-3.0, 0.0]
    stats = server.outer.worker_stats()
    assert (stats[1]["pull_bytes"], stats[1]["dense_pulls"]) == (12 + 16, 1)


def test_int8_pulls_beside_sparseloco_encode_the_change_and_do_not_forward_the_rounds() -> None:
    """``outer="sparseloco"`` with ``pull_compression="int8"``: a pull is the int8 encoding of the public model's
    change (as under any outer step), not the rounds' pushes forwarded; only a sparse pull codec forwards them."""
    shapes = [torch.Size([64])]
    int8 = Fragments(shapes, "topk2", pull_compression="int8", forward=SparseLoCo().forward(4))
    assert [type(c) for c in int8.delta_codecs] == [Int8]
    sparse = Fragments(shapes, "topk2", pull_compression="topk2", forward=SparseLoCo().forward(4))
    assert all(isinstance(c, RoundCodec) and c.workers == 4 for c in sparse.delta_codecs)
