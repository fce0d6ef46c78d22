"""HDETCallback's settings as one validated, immutable value (pure: no Lightning, no process groups)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_hdet._checks import (
    check_bool,
    check_choice,
    check_int,
    check_integer,
    check_number,
    check_positive,
    is_finite_number,
    require,
)
from lightning_hdet.hdet.blends import BLENDS

VOTES = ("softmax", "best")


@dataclass(frozen=True)
class HDETConfig:
    """Every argument of :class:`~lightning_hdet.hdet.callback.HDETCallback` (documented there), checked on creation.

    Errors name the argument, the value and what is allowed, before any process or process group exists.
    """

    every_n_steps: int = 100
    vote: str = "softmax"
    temperature: float = 0.1
    momentum: float = 0.9
    meta_lr: float = 0.5
    warmup_steps: int = 0
    permute: bool = True
    shrink: float = 0.5
    min_spread: float = 0.05
    blend: str = "mean"
    blend_strength: float = 1.0
    monitor: Optional[str] = None
    init_noise: float = 0.0
    safety_net: bool = True
    divergence_factor: Optional[float] = 10.0
    rescue_lr_factor: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, minimum=1)
        check_choice("vote", self.vote, VOTES)
        check_positive("temperature", self.temperature)
        check_number("momentum", self.momentum, 0.0, 1.0, high_open=True)
        check_number("meta_lr", self.meta_lr, low=0.0)
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_bool("permute", self.permute)
        check_number("shrink", self.shrink, 0.0, 1.0, low_open=True)
        check_positive("min_spread", self.min_spread)
        check_choice("blend", self.blend, BLENDS)
        check_number("blend_strength", self.blend_strength, 0.0, 1.0, low_open=True)
        require("monitor", self.monitor, self.monitor is None or (isinstance(self.monitor, str) and self.monitor != ""),
                "None or a logged metric name")
        check_number("init_noise", self.init_noise, low=0.0)
        check_bool("safety_net", self.safety_net)
        factor = self.divergence_factor
        require("divergence_factor", factor, factor is None or (is_finite_number(factor) and factor > 1),
                "None or a finite number > 1")
        check_number("rescue_lr_factor", self.rescue_lr_factor, 0.0, 1.0, low_open=True, high_open=True)
        check_integer("seed", self.seed)

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded in the logger's run config under ``hdet/callback/...``."""
        return asdict(self)
