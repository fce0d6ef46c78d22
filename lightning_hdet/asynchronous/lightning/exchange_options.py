"""The exchange's arguments checked together, for both strategies (Trainer and Fabric): the codecs, the outer
optimizer object and the overlap with its staggered parts depend on one another, and each check names the argument
it refuses. Pure: no Lightning, no process groups."""

from __future__ import annotations

from typing import Any

from lightning_hdet.asynchronous.exchange.overlap import check_overlap_steps, check_stagger_exchange
from lightning_hdet.asynchronous.exchange.ranks import check_ranks_per_worker
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import Codec, check_codecs, codec_from


def check_exchange_options(settings: OuterSettings, compression: Any, error_feedback: bool | None,
                           pull_compression: Any, overlap_steps: int = 0,
                           ranks_per_worker: int = 1) -> tuple[Codec, Codec, bool]:
    """Check the codec, ``ranks_per_worker``, ``overlap_steps`` and ``stagger`` arguments against the outer
    ``settings`` (which checked ``stagger`` with ``mode`` and ``local_steps``); returns the push and pull codec
    objects and whether error feedback is in force. Raises the package's ``ValueError``."""
    push, pull = codec_from(compression), codec_from(pull_compression, "pull_compression")
    settings.outer.check_codecs(push, pull)
    feedback = check_codecs(push, pull, error_feedback, settings.outer.forwards_rounds)
    check_ranks_per_worker(ranks_per_worker)
    check_overlap_steps(overlap_steps, settings.local_steps, ranks_per_worker, settings.stagger)
    check_stagger_exchange(settings.stagger, pull, overlap_steps)
    return push, pull, feedback
