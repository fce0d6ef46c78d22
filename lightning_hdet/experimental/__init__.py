"""Research options of HDET, each kept because a measurement needs it (docs/experimental.md says which).

Nothing here is needed for the recommended set-up, and nothing here is in docs/hdet.md or ``make bench``'s
default arms. They plug into :class:`~lightning_hdet.HDETCallback` where the option they replace lived:

* ``vote=Halving()`` (successive halving; with ``gradient_sync="cluster"`` losers join the winners' clusters),
  ``vote=PartialMerge(Softmax(), strength=s)`` (the old ``blend_strength``: benchmark 1's "without blending" arm);
* the callback :class:`InitNoise` (the published warm start, the old ``init_noise``: benchmark 1's published arms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_hdet._checks import KnownArguments, check_integer, check_number, require
from lightning_hdet.experimental.halving import Halving
from lightning_hdet.hdet.rules.options import Softmax, Vote
from lightning_hdet.hdet.rules.votes import Ballot, VoteResult

__all__ = ["Halving", "InitNoise", "PartialMerge"]


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

