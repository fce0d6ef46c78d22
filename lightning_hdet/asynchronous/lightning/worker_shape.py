"""What one worker is (:class:`WorkerShape`, ``worker=``), and the exchange's interdependent arguments checked
together for the Trainer and Fabric strategies (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_hdet._checks import ArgumentNameError, KnownArguments, check_int
from lightning_hdet.asynchronous.exchange.ranks import check_ranks_per_worker
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import Codec, check_codecs, codec_from


@dataclass(frozen=True)
class WorkerShape(KnownArguments):
    """How one worker trains and exchanges (``AsyncLocalSGDStrategy(worker=WorkerShape(...))``).

    Args:
        ranks_per_worker: ``k`` consecutive ranks (e.g. a node's) train one worker, DDP inside, and push once per
            round; a divisor of the world size leaving >= 2 workers.
        inside_worker: ``"ddp"`` (each rank holds the model) or ``"fsdp"`` (FSDP2 over the worker's ``k >= 2`` ranks).
        auto_wrap_policy: with ``"fsdp"``, the submodules that become FSDP2 units (as Lightning's ``FSDPStrategy``).
        overlap_steps: ``τ``, inner steps taken while the exchange travels, then merged (0: blocking).
        stagger: DiLoCo, with ``overlap_steps``: the model synchronised in ``F`` parts, one every ``local_steps /
            F`` steps (Streaming DiLoCo). See ``docs/async.md``.
    """

    ranks_per_worker: int = 1
    inside_worker: str = "ddp"
    auto_wrap_policy: Any = None
    overlap_steps: int = 0
    stagger: int = 1

    def __post_init__(self) -> None:
        check_ranks_per_worker(self.ranks_per_worker)
        check_int("overlap_steps", self.overlap_steps, minimum=0,
                  hint="0 is a blocking exchange; τ > 0 inner steps are taken while a round's push and pull travel.")

    def numbers(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "auto_wrap_policy"}


def refuse_shape_arguments(owner: str, given: Mapping[str, Any]) -> None:
    """Refuse a :class:`WorkerShape` option passed to the strategy itself, naming the object."""
    for name, value in given.items():
        if name in ("ranks_per_worker", "inside_worker", "auto_wrap_policy", "overlap_steps", "stagger"):
            raise ArgumentNameError(f"{owner} no longer takes `{name}`={value!r}: what one worker is, is an object."
                                    f" Write worker=WorkerShape({name}={value!r}) (see docs/async.md).")


def check_exchange_options(settings: OuterSettings, compression: Any, error_feedback: bool | None,
                           pull_compression: Any, overlap_steps: int = 0,
                           ranks_per_worker: int = 1) -> tuple[Codec, Codec, bool]:
    """Check the codecs and the worker's shape (a :class:`WorkerShape`'s) against ``settings``; codecs, feedback."""
    push, pull = codec_from(compression), codec_from(pull_compression, "pull_compression")
    settings.outer.check_codecs(push, pull)
    feedback = check_codecs(push, pull, error_feedback, settings.outer.forwards_rounds)
    check_overlap_steps(overlap_steps, settings.rounds, ranks_per_worker, settings.stagger)
    check_stagger_exchange(settings.stagger, pull, overlap_steps)
    return push, pull, feedback


def check_overlap_steps(overlap_steps: int, local_steps: int, ranks_per_worker: int, stagger: int = 1) -> None:
    """``overlap_steps`` (>= 0): 0 or ``1..local_steps / stagger − 1``; not with workers of several ranks."""
    round_steps = local_steps // stagger
    if overlap_steps and overlap_steps >= round_steps:
        rounds = f"local_steps={local_steps}" + (f" / stagger={stagger}" if stagger > 1 else "")
        raise ValueError(f"`overlap_steps={overlap_steps}` leaves no step of a round before its push ({rounds});"
                         f" allowed: 0 (a blocking exchange) or 1..{round_steps - 1}.")
    if overlap_steps and ranks_per_worker > 1:
        raise ValueError(f"`overlap_steps={overlap_steps}` is not supported with `ranks_per_worker={ranks_per_worker}`:"
                         " a worker of several ranks hands its reply on with collectives of its own group, which"
                         " cannot run beside its training. Use overlap_steps=0, or ranks_per_worker=1.")


def check_stagger_exchange(stagger: int, pull_compression: Codec, overlap_steps: int) -> None:
    """What ``stagger > 1`` is not built for: a blocking exchange and pulls of changes (of the whole model)."""
    if stagger > 1 and not overlap_steps:
        # blocking, the goodbye carries no steps and the other parts' last steps would be lost
        raise ValueError(f"`stagger={stagger}` needs `overlap_steps` >= 1, got overlap_steps=0: a staggered run"
                         " ends with overlapped steps that carry every part's last steps. Give overlap_steps, or"
                         " use stagger=1.")
    if stagger > 1 and pull_compression.sends_changes:
        raise ValueError(f"`stagger={stagger}` is not supported with `pull_compression={pull_compression!r}`, whose"
                         " pulls carry changes of the whole model. Use pull_compression='none' or 'bf16', or"
                         " stagger=1.")
