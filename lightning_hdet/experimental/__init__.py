"""Research options of HDET that our benchmarks measured as not helping (docs/benchmarks.md); kept for research.

Nothing here is needed for the recommended set-up, and nothing here is in docs/hdet.md or ``make bench``'s
default arms; each is described in docs/experimental.md with the measurement that put it here. They plug into
:class:`~lightning_hdet.HDETCallback` where the option they replace lived:

* ``vote=PB2()`` (level with ``PBT``), ``vote=ReferencePBT(reference_group=g)`` (level with ``PBT``),
  ``vote=Halving()`` (successive halving; with ``gradient_sync="cluster"`` losers join the winners' clusters),
  ``vote=PartialMerge(Softmax(), strength=s)`` (the old ``blend_strength``: no visible difference);
* ``signal=Improvement()`` (worse than ``"mean"`` in 6 of 6 cells), ``signal=Forecast()`` (level or worse),
  ``signal=Heldout()`` (level, 2 % worse on shapes);
* the callback :class:`InitNoise` (the published warm start, the old ``init_noise``: no visible difference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_hdet._checks import KnownArguments, check_int, check_integer, check_number, require
from lightning_hdet.experimental.halving import Halving
from lightning_hdet.experimental.pb2 import PB2
from lightning_hdet.hdet.lightning.heldout import HeldoutLoss, HeldoutScorer
from lightning_hdet.hdet.rules.options import PBT, Signal, Softmax, Vote
from lightning_hdet.hdet.rules.selection import Selection
from lightning_hdet.hdet.rules.signals import CURVE_BINS, scores
from lightning_hdet.hdet.rules.votes import Ballot, VoteResult

if TYPE_CHECKING:
    from lightning_hdet.hdet.rules.controller import Interval

__all__ = ["Forecast", "Halving", "Heldout", "Improvement", "InitNoise", "PB2", "PartialMerge", "ReferencePBT"]


@dataclass(frozen=True)
class ReferencePBT(PBT):
    """PBT with a slow reference group (MF-PBT, arXiv 2506.03225), exempt from selection but every
    ``reference_every``-th vote: a longer-horizon member the greedy ones are measured against. Measured level with
    :class:`~lightning_hdet.PBT`.

    Args:
        reference_group: index of the reference group (below the number of groups).
        reference_every: how often the reference group takes part in selection (>= 1).
    """

    reference_group: int = 0
    reference_every: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("reference_group", self.reference_group, minimum=0)
        check_int("reference_every", self.reference_every, minimum=1)

    def explore(self, ballot: Ballot, generator: torch.Generator) -> Selection:
        n = len(ballot.losses)
        require("reference_group", self.reference_group, self.reference_group < n,
                f"a group index below the number of groups ({n})")
        return super().explore(ballot, generator)

    def exempt(self, vote: int) -> Optional[int]:
        return self.reference_group if vote % self.reference_every else None


@dataclass(frozen=True)
class PartialMerge(Vote):
    """``vote`` with partial merges: ``theta_g <- (1 - strength) * theta_g + strength * target`` (the old
    ``blend_strength``; a PBT copy takes ``strength`` of its source). No visible difference measured."""

    vote: Vote = field(default_factory=Softmax)
    strength: float = 1.0

    def __post_init__(self) -> None:
        require("vote", self.vote, isinstance(self.vote, Vote) and not isinstance(self.vote, PartialMerge),
                "a vote object such as Softmax(), Best() or PBT()")
        check_number("strength", self.strength, 0.0, 1.0, low_open=True)

    # The wrapped vote decides; only the merge's strength is this rule's.
    @property
    def name(self) -> str:  # type: ignore[override]
        return self.vote.name

    @property
    def copies(self) -> bool:  # type: ignore[override]
        return self.vote.copies

    @property
    def blend(self) -> str:  # type: ignore[override]
        return self.vote.blend

    def explore(self, ballot: Ballot, generator: torch.Generator) -> VoteResult:
        return self.vote.explore(ballot, generator)

    def fresh(self) -> "PartialMerge":
        return PartialMerge(self.vote.fresh(), self.strength)

    def check_signal(self, signal: Any) -> None:
        self.vote.check_signal(signal)

    def check_strategy(self, gradient_sync: str, explored: Sequence[str]) -> None:
        self.vote.check_strategy(gradient_sync, explored)

    def options(self) -> dict[str, Any]:
        return {**self.vote.options(), "strength": self.strength}

    def state_dict(self) -> dict:
        return self.vote.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.vote.load_state_dict(state)


@dataclass(frozen=True)
class Improvement(Signal):
    """The vote compares the least-squares slope of each group's loss over the interval (FIRE-PBT). Worse than
    ``"mean"`` in 6 of 6 cells.

    Args:
        bins: the interval's loss curve is kept as this many bins on the device.
    """

    name: ClassVar[str] = "improvement"
    level: ClassVar[bool] = False
    bins: int = CURVE_BINS

    def __post_init__(self) -> None:
        check_int("curve_bins", self.bins, minimum=2)

    def scores(self, interval: Interval, every: int) -> Optional[list[float]]:
        if interval.refine or interval.curves is None:  # the search's end picks by level
            return None
        return scores(interval.curves, self.name, every)


@dataclass(frozen=True)
class Forecast(Signal):
    """The vote compares each group's fitted curve ``a + b exp(-c t)`` read ``horizon`` steps after the interval's
    start (AutoLRS). Level with ``"mean"`` or worse.

    Args:
        horizon: steps from an interval's start at which the fit is read (``None``: four intervals).
        bins: the interval's loss curve is kept as this many bins on the device.
    """

    name: ClassVar[str] = "forecast"
    horizon: Optional[int] = None
    bins: int = CURVE_BINS

    def __post_init__(self) -> None:
        check_int("forecast_horizon", self.horizon, minimum=1, optional=True,
                  hint="Steps from the start of an interval; None: four intervals.")
        check_int("curve_bins", self.bins, minimum=2)

    def scores(self, interval: Interval, every: int) -> Optional[list[float]]:
        if interval.refine or interval.curves is None:  # the search's end picks by level
            return None
        return scores(interval.curves, self.name, every, self.horizon)


@dataclass(frozen=True)
class Heldout(Signal):
    """Every group's averaged parameters scored on the same validation batches
    (:mod:`lightning_hdet.hdet.lightning.heldout`). Level with ``"mean"``, 2 % worse on shapes.

    Args:
        batches: validation batches every group scores at a vote (split over a group's ranks).
        decay: ``None`` averages the interval's iterates uniformly; a float in [0, 1) is an EMA decay.
        loss: ``(module, batch) -> mean loss``; ``None`` calls ``module.heldout_loss(batch)``.
    """

    name: ClassVar[str] = "heldout"
    batches: int = 4
    decay: Optional[float] = None
    loss: Optional[HeldoutLoss] = None

    def __post_init__(self) -> None:
        check_int("heldout_batches", self.batches, minimum=1,
                  hint="Validation batches every group scores at a vote with signal='heldout'.")
        check_number("heldout_decay", self.decay, 0.0, 1.0, high_open=True, optional=True,
                     hint="None: the interval's uniform average; a float: an EMA with that decay.")

    def scores(self, interval: Interval, every: int) -> Optional[list[float]]:
        return None if interval.heldout is None else list(interval.heldout)

    def options(self) -> dict[str, Any]:
        return {"name": self.name, "batches": self.batches, "decay": self.decay}  # (not the loss function)

    def scorer(self) -> HeldoutScorer:
        return HeldoutScorer(self.batches, self.decay, self.loss)


class InitNoise(KnownArguments, Callback):
    """The published warm start: at the start of a fresh fit each group's parameters become ``theta_0 + eps``,
    ``eps ~ N(0, std^2 |theta_0|^2 / d)``, distinct per group and equal within one (paper: ``std=0.01``). No
    visible difference measured. Use with ``strategy="hdet"`` or ``"hdet_fsdp"``.

    Args:
        std: the noise's standard deviation relative to the parameters' RMS (> 0).
        seed: seed of the noise (group ``g`` draws from ``seed * 100003 + g + 1``; the global RNG is never touched).
    """

    def __init__(self, std: float = 0.01, seed: int = 0) -> None:
        check_number("std", std, low=0.0, low_open=True)
        check_integer("seed", seed)
        self.std = std
        self.seed = seed

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before HDETCallback's ``on_train_start`` keeps its restore point, so a roll-back keeps the noise."""
        strategy: Any = trainer.strategy
        require("strategy", type(strategy).__name__, hasattr(strategy, "add_init_noise"),
                "an HDET strategy ('hdet', 'hdet_fsdp')")
        if trainer.ckpt_path is None:  # a resumed run continues from its checkpoint's parameters
            strategy.add_init_noise(self.std, self.seed * 100_003 + strategy.group_index + 1)

