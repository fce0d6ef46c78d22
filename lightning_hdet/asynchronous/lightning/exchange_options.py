"""The exchange's arguments checked together, for both strategies (Trainer and Fabric): the codecs, SparseLoCo's
update and the overlap with its staggered parts depend on one another, and each check names the argument it
refuses. Pure: no Lightning, no process groups."""

from __future__ import annotations

from lightning_hdet.asynchronous.exchange.overlap import check_overlap_steps, check_stagger_exchange
from lightning_hdet.asynchronous.exchange.ranks import check_ranks_per_worker
from lightning_hdet.asynchronous.outer.sparseloco import check_sparse_outer
from lightning_hdet.asynchronous.outer.state import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import check_compression


def check_exchange_options(settings: OuterSettings, compression: str, error_feedback: bool | None,
                           pull_compression: str, error_decay: float | None, overlap_steps: int = 0,
                           ranks_per_worker: int = 1) -> tuple[bool, float | None]:
    """Check the codec, ``error_decay``, ``ranks_per_worker``, ``overlap_steps`` and ``stagger`` arguments against
    the outer ``settings`` (which checked ``stagger`` with ``mode``, ``local_steps`` and ``outer``); returns whether
    error feedback is in force and the error feedback's decay (``None``: plain). Raises the package's
    ``ValueError``."""
    sparse = settings.preset.sparse
    error_decay = check_sparse_outer(sparse, compression, error_decay)
    feedback = check_compression(compression, error_feedback, pull_compression, sparse_outer=sparse)
    check_ranks_per_worker(ranks_per_worker)
    check_overlap_steps(overlap_steps, settings.local_steps, ranks_per_worker, settings.stagger)
    check_stagger_exchange(settings.stagger, pull_compression, overlap_steps)
    return feedback, error_decay
