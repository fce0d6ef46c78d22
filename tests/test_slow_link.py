"""The emulated slow link: a worker's exchange held as long as its bytes take on the link (one process, a fake
transport and a recorded sleep, hand-computed), the wrapper over another transport's ends, then ``SlowLink`` in a
2-worker fit (given as a callback: it wraps the strategy's transport)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hdet import AsyncLocalSGDStrategy, PointToPoint, SlowLink
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.network import Link
from lightning_hdet.asynchronous.wire.slow_link import LimitedTransport
from lightning_hdet.asynchronous.wire.transport import WorkerTransport
from lightning_hdet.testing import MemoryTransport


class Loopback(WorkerTransport):
    """Takes a push whole (its fragments consumed, as a real transport does) and answers with ``reply``."""

    def __init__(self, reply: ServerHeader) -> None:
        self.reply, self.fragments = reply, 0

    def push(self, header, messages, buffers, inner_state) -> None:
        self.fragments += sum(1 for _ in messages)

    def pull(self, into):
        return self.reply


def test_a_push_and_a_pull_take_their_bytes_over_the_bandwidth_plus_the_latency() -> None:
    """8,000 bits/s (1,000 bytes/s), 0.5 s latency. A push: a 56-byte header (7 float64), 2 fragments of 100 bytes,
    4 float32 buffer values (16 bytes), no inner state: 272 bytes, 0.272 + 0.5 s. A pull of a 700-byte model: a
    48-byte header (6 float64) + 700 bytes, 0.748 + 0.5 s; one of 2 changes of 50 bytes each (a delta pull codec):
    48 + 100 bytes, 0.148 + 0.5 s; a stop reply carries no model: 0.048 + 0.5 s."""
    waited: list[float] = []
    inner = Loopback(ServerHeader(8, 3))
    link = LimitedTransport(inner, bits_per_s=8000, latency_s=0.5,
                            reply_bytes=lambda reply: 700 if reply.deltas < 0 else 50 * reply.deltas,
                            sleep=waited.append)
    fragments = [torch.zeros(100, dtype=torch.uint8), torch.zeros(25, dtype=torch.float32)]
    link.push(WorkerHeader(Kind.PUSH, 8, 1.0, 0.0, 0), iter(fragments), torch.zeros(4), None)
    assert inner.fragments == 2 and link.pull(torch.zeros(1)) == ServerHeader(8, 3)
    inner.reply = ServerHeader(8, 5, deltas=2)
    link.pull(torch.zeros(1))
    inner.reply = ServerHeader(0, 4)
    link.pull(torch.zeros(1))
    assert waited == pytest.approx([0.772, 1.248, 0.648, 0.548]) and link.delay_s == pytest.approx(3.216)


def test_the_link_wraps_the_chosen_workers_ends_of_any_transport() -> None:
    """Over the in-memory transport, 3 workers of 2 ranks each: by default every worker's end but rank 0's is slowed;
    ``ranks=[0, 4]`` slows rank 0's in-process end and worker 2's (leader rank 4), not worker 1's. A pull's bytes
    count the layout's reply (3 float32 parameters) and the link's 2 float32 buffer values."""
    link = Link(Fragments([torch.Size([3])]), n_buffers=2, ranks_per_worker=2)
    local = Loopback(ServerHeader(4, 1))
    default, chosen = SlowLink(8000), SlowLink(8000, ranks=[0, 4], inner=MemoryTransport())
    assert default.local_end(local, link) is local and isinstance(default.inner, PointToPoint)
    assert isinstance(chosen.local_end(local, link), LimitedTransport)
    assert not isinstance(chosen.worker_end(link, 1), LimitedTransport)
    slowed = chosen.worker_end(link, 2)
    assert isinstance(slowed, LimitedTransport) and slowed.reply_bytes(ServerHeader(4, 1)) == 12 + 8
    assert repr(chosen) == "SlowLink(bits_per_s=8000, latency_s=0, ranks=[0, 4], inner=MemoryTransport(timeout=60))"
    with pytest.raises(TypeError, match="`transport='gloo'` is not a Transport"):
        AsyncLocalSGDStrategy(transport="gloo")


def test_as_a_callback_it_wraps_the_strategys_own_transport_once() -> None:
    strategy = AsyncLocalSGDStrategy(transport=MemoryTransport())
    link, trainer = SlowLink(8000), SimpleNamespace(strategy=strategy)
    link.setup(trainer, None, "fit")
    link.setup(trainer, None, "validate")  # a later entry: already in place
    assert strategy.transport is link and isinstance(link.inner, MemoryTransport)
    with pytest.raises(ValueError, match="SlowLink slows the exchange of AsyncLocalSGDStrategy; object has none"):
        SlowLink(8000).setup(SimpleNamespace(strategy=object()), None, "fit")


def test_the_link_is_checked_when_it_is_made() -> None:
    with pytest.raises(ValueError, match="`bits_per_s` must be a finite number > 0, got 0"):
        SlowLink(bits_per_s=0)
    with pytest.raises(ValueError, match="`latency_s` must be a finite number >= 0, got -1"):
        SlowLink(bits_per_s=1e6, latency_s=-1)


class Delays(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        worker = trainer.strategy._exchange.worker
        delay = getattr(worker.transport, "delay_s", None)
        torch.save({"delay": delay, "rounds": worker.rounds}, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.timeout(180)
def test_slow_link_holds_every_worker_but_rank_0_for_its_bytes(tmp_path: Path) -> None:
    """BoringModel (66 float32 parameters, no buffers), H = 4, 80,000 bits/s, 10 ms latency. Rank 1's pushes weigh
    56 + 264 bytes, its pulls 48 + 264 (a stop: 48), and after the stop its goodbye 56 (a header, nothing left to
    push); its first exchange, the hello, a 56-byte header and a pull of 48 + 264 bytes, too. Rank 0's worker shares the outer optimizer's process: not
    slowed. DiLoCo, so that the rounds are fixed by construction: every worker runs every round, a budget of
    2 x 16 steps is 4 rounds of 4 each, so rank 1 pushes 4 times, pulls the model 3 times and is then told to stop.
    (Async shares the budget first come, first served: rank 0, not slowed, may take rank 1's later rounds, or all
    of them on a loaded machine.)"""
    seed_everything(0)
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode="sync", start_method="fork")
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2,
                      max_steps=16, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[SlowLink(bits_per_s=80_000, latency_s=0.01), Delays(tmp_path)])
    trainer.fit(BoringModel())
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank0["delay"] is None
    assert [steps for steps, _ in rank1["rounds"]] == [4, 4, 4, 4, 0]  # the hello's reply, then 4 exchanges
    seconds = 4 * (0.01 + 8 * 320 / 80_000) + 4 * (0.01 + 8 * 312 / 80_000) + (0.01 + 8 * 48 / 80_000) \
        + 2 * (0.01 + 8 * 56 / 80_000)
    assert rank1["delay"] == pytest.approx(seconds)
