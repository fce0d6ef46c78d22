"""Testing and benchmarking aids: HDET in one process, and devices of unequal speed on one machine.

:class:`FakeWorld` (see :mod:`lightning_hdet.hdet.execution.fake`) holds every HDET group's parameters as plain tensors
and implements the strategy side of HDET for each group, so an :class:`~lightning_hdet.HDETCallback` (or your own vote
rule) can be tested in one process, without a process group, against values computed by hand::

    world = FakeWorld(params=[[1.0], [3.0]], lr_multipliers=[1.0, 2.0])
    world.fit(lambda: HDETCallback(every_n_steps=2, vote=Softmax(), search=False),
              train_step=lambda executor, step: 1.0 / (step + 1 + executor.group_index), max_steps=2)
    world.params  # both groups at the mean, [[2.0], [2.0]]

:class:`SlowRanks` pads every training step of each rank to a target duration, so ``devices=4`` CPU
processes behave like four devices whose step times have the given ratios. Padding to a target (rather than
adding a fixed sleep) keeps the ratios stable even when the real compute time is noisy. :class:`SlowLink` makes
each async worker's exchange take as long as its bytes would on a link of a given bandwidth and latency.

Example -- the four-worker step times of the asynchronous Local-SGD paper (0.58 / 0.75 / 1.51 / 3.33 s),
scaled down 100x::

    trainer = Trainer(strategy="async_local_sgd", devices=4, callbacks=[SlowRanks.published(scale=0.01)])
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_hdet._checks import KnownArguments
from lightning_hdet.asynchronous.wire.memory import MemoryTransport
from lightning_hdet.asynchronous.wire.network import Transport
from lightning_hdet.asynchronous.wire.slow_link import LimitedLink
from lightning_hdet.hdet.execution.fake import FakeExecutor, FakeModule, FakeTrainer, FakeWorld

#: Seconds per step of the four heterogeneous workers in the asynchronous Local-SGD paper's toy example.
PUBLISHED_STEP_SECONDS: tuple[float, ...] = (0.58, 0.75, 1.51, 3.33)


class SlowRanks(KnownArguments, Callback):
    """Pad each training step of a rank to ``factors.get(rank, 1) * base_seconds`` seconds.

    Args:
        factors: slow-down factor per global rank (ranks not listed use factor 1).
        base_seconds: step duration of a factor-1 rank; each factor-1 rank is padded to it too, so that
            all ranks' step times have exactly the given ratios.
    """

    def __init__(self, factors: Mapping[int, float], base_seconds: float = 0.01) -> None:
        if base_seconds <= 0:
            raise ValueError(f"`base_seconds` must be > 0, got {base_seconds!r}.")
        for rank, factor in factors.items():
            if factor < 1:
                raise ValueError(f"slow-down factor for rank {rank} must be >= 1, got {factor!r}.")
        self.factors = dict(factors)
        self.base_seconds = base_seconds
        self._start = 0.0

    @classmethod
    def published(cls, scale: float = 0.01) -> SlowRanks:
        """The paper's 0.58 / 0.75 / 1.51 / 3.33 s step times (ranks 0-3) multiplied by ``scale``."""
        fastest = PUBLISHED_STEP_SECONDS[0]
        return cls({r: s / fastest for r, s in enumerate(PUBLISHED_STEP_SECONDS)}, base_seconds=fastest * scale)

    def step_seconds(self, rank: int) -> float:
        """The target duration of one training step on ``rank``."""
        return self.factors.get(rank, 1.0) * self.base_seconds

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        remaining = self.step_seconds(trainer.global_rank) - (time.perf_counter() - self._start)
        if remaining > 0:
            time.sleep(remaining)


class SlowLink(KnownArguments, LimitedLink, Callback):
    """Emulate a slow link between async workers and the outer optimizer (``AsyncLocalSGDStrategy``, either mode):
    every push and pull of a worker behind it holds that worker as long as its bytes take at ``bits_per_s`` plus
    ``latency_s``. A transport wrapper: ``AsyncLocalSGDStrategy(transport=SlowLink(1e9))``; given in the Trainer's
    ``callbacks`` instead, it wraps the strategy's transport at set-up.

    Args:
        bits_per_s: the link's bandwidth (e.g. ``1e9`` for 1 Gbit/s).
        latency_s: seconds added to every message, each way.
        ranks: the workers behind the slow link, by their (leader's) global rank (default: every worker but rank
            0's, whose worker shares rank 0's process with the outer optimizer, as a worker co-located with the
            server would).
        inner: the transport it slows (default: ``PointToPoint()``).
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(getattr(strategy, "transport", None), Transport):
            raise ValueError(f"SlowLink slows the exchange of AsyncLocalSGDStrategy; {type(strategy).__name__} has"
                             " none. Remove it from the callbacks, or use strategy='async_local_sgd' / 'diloco'.")
        if strategy.transport is not self:  # as a callback: over the transport the strategy was given
            self.inner, strategy.transport = strategy.transport, self


__all__ = ["GLOO_THREADS", "PUBLISHED_STEP_SECONDS", "FakeExecutor", "FakeModule", "FakeTrainer", "FakeWorld",
           "MemoryTransport", "SlowLink", "SlowRanks", "live_gloo_threads", "live_process_groups"]


def live_process_groups() -> int:
    """How many process groups besides the default one are alive in this process (0 before ``init_process_group``).

    After a trainer entry returns, a strategy of this package should have released every group it created; the
    default group stays (Lightning reuses it for the next entry) until the interpreter exits.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed import distributed_c10d  # why: the registry of live groups has no public accessor

    return sum(1 for pg in distributed_c10d._world.pg_map if pg is not dist.GroupMember.WORLD)


#: The names (as Linux shows them) of the native threads a gloo process group runs while it exists.
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def live_gloo_threads() -> int | None:
    """How many native gloo threads this process runs (``None`` where ``/proc`` is missing, i.e. not Linux).

    A destroyed group's threads end only once nothing references the group any more; after a trainer entry, only the
    default group's should be left.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sum(name in GLOO_THREADS for name in names)
