"""Delta pulls: rank 0's public model, its log of compressed changes, and their trip over the real wire code. Values
are computed by hand in the comments."""

from __future__ import annotations

import pytest
import torch

from lightning_hdet.asynchronous.exchange.public_model import PublicModel
from lightning_hdet.asynchronous.wire.messages import Fragments, ServerHeader
from lightning_hdet.asynchronous.wire.transport import receive_reply, send_reply


def test_int8_changes_follow_the_global_model_and_what_they_leave_out_follows_later() -> None:
    """One fragment of 4 values (one int8 row: 4 bytes of scale, 4 of values). G1 = [1.27, -0.635, 0.1, 0]: the
    scale is 1.27 / 127 = 0.01, the levels round(G1 / 0.01) = [127, -64, 10, 0] (-63.5 rounds to even), so P1 =
    [1.27, -0.64, 0.1, 0] and G1 - P1 = [0, 0.005, 0, 0] waits for the next change, which carries it whole (its
    one value is its row's maximum): P2 = G1."""
    layout = Fragments([torch.Size([4])], pull_compression="int8")
    public = PublicModel(torch.zeros(4), layout)
    assert public.change_nbytes == 8
    deltas, messages = public.reply(1)  # worker 1's first pull: the model itself
    assert deltas == -1 and [m.tolist() for m in messages] == [[0.0] * 4]
    g1 = torch.tensor([1.27, -0.635, 0.1, 0.0])
    public.publish(g1, source_version=1)
    torch.testing.assert_close(public.params, torch.tensor([1.27, -0.64, 0.1, 0.0]))
    public.publish(g1 + 5, source_version=1)  # the same outer version again: nothing to publish
    assert public.version == 1
    deltas, messages = public.reply(1)
    assert deltas == 1 and [m.numel() for m in messages] == [8]
    assert messages[0][4:].view(torch.int8).tolist() == [127, -64, 10, 0]
    public.publish(g1, source_version=2)
    torch.testing.assert_close(public.params, g1)
    assert public.reply(1)[0] == 1 and public.reply(2)[0] == -1  # worker 2 never pulled: the model itself


def test_a_worker_behind_the_log_gets_the_model_itself() -> None:
    """A log of one change (8 bytes): worker 1 holds version 0; after versions 1 and 2 only change 2 is kept, so
    worker 1 is sent P; worker 2, at version 1, gets change 2 alone."""
    layout = Fragments([torch.Size([4])], pull_compression="int8")
    public = PublicModel(torch.zeros(4), layout, max_log_bytes=8)
    public.reply(1)
    public.publish(torch.ones(4), source_version=1)
    assert public.reply(2)[0] == -1
    public.publish(torch.full((4,), 2.0), source_version=2)
    assert public.reply(1)[0] == -1 and public.reply(2)[0] == 1
    assert public.reply(2) == (0, [])  # up to date: nothing follows


def test_the_log_keeps_only_what_some_worker_lacks() -> None:
    """Workers 1 and 2 hold version 0. Change 1 is kept until both pulled it; change 2 is kept for worker 2 alone
    until it leaves."""
    layout = Fragments([torch.Size([4])], pull_compression="int8")
    public = PublicModel(torch.zeros(4), layout)
    public.reply(1), public.reply(2)
    public.publish(torch.ones(4), source_version=1)
    assert public.logged == 1
    public.reply(1)
    assert public.logged == 1
    public.reply(2)
    assert public.logged == 0
    public.publish(torch.full((4,), 2.0), source_version=2)
    public.reply(1)
    assert public.logged == 1
    public.forget(2)
    assert public.logged == 0


def test_until_a_worker_holds_a_version_the_public_model_is_the_global_one() -> None:
    layout = Fragments([torch.Size([4])], pull_compression="topk2")
    public = PublicModel(torch.zeros(4), layout)
    public.publish(torch.tensor([0.3, -0.2, 0.1, 0.7]), source_version=1)
    assert public.version == 0 and public.params.tolist() == pytest.approx([0.3, -0.2, 0.1, 0.7])


def test_a_layout_without_a_delta_codec_is_refused() -> None:
    with pytest.raises(ValueError, match="delta pull codec"):
        PublicModel(torch.zeros(2), Fragments([torch.Size([2])], pull_compression="bf16"))


@pytest.mark.parametrize("codec", ["int8", "topk2", "topk4"])
def test_over_the_wire_every_worker_holds_the_public_model_bit_for_bit(codec: str) -> None:
    """Two fragments (a 3 x 50 weight, a bias of 7), 12 random steps of G. Worker 1 pulls every version, worker 2
    every third: each adds the changes it lacks, oldest first, to what it holds, and ends equal to P exactly; the
    wire carries the header, the changes and the buffers, no more."""
    layout = Fragments([torch.Size([3, 50]), torch.Size([7])], pull_compression=codec, max_bytes=600)
    assert len(layout.ranges) == 2
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(layout.numel, generator=generator)
    public = PublicModel(g, layout)
    held = {1: torch.empty(layout.numel + 1), 2: torch.empty(layout.numel + 1)}

    def pull(worker: int) -> int:
        deltas, messages = public.reply(worker)
        wire: list[torch.Tensor] = []
        send_reply(lambda t: wire.append(t.clone()), ServerHeader(4, 0, 0, deltas), messages, torch.tensor([9.0]))
        assert sum(t.numel() * t.element_size() for t in wire) == 48 + layout.reply_nbytes(deltas) + 4
        it = iter(wire)
        header = receive_reply(lambda t: t.copy_(next(it)), layout, held[worker], layout.pull_buffer())
        assert header.deltas == deltas and next(it, None) is None
        assert torch.equal(held[worker][: layout.numel], public.params) and held[worker][-1].item() == 9.0
        return deltas

    assert pull(1) == pull(2) == -1
    for version in range(1, 13):
        g = g + 0.1 * torch.randn(layout.numel, generator=generator)
        public.publish(g, source_version=version)
        assert pull(1) == 1
        if version % 3 == 0:
            assert pull(2) == 3
