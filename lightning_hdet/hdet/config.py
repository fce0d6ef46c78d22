"""HDETCallback's rules resolved into one flat, validated, immutable value (pure: no Lightning, no process groups).

Users never build it: :func:`~lightning_hdet.hdet.options.resolve` does, from the rule objects, and the controller
reads it. Every check lives here once, so an error names the argument whichever object carried it."""

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
from lightning_hdet.hdet.bandit import PB2Vote
from lightning_hdet.hdet.blends import BLENDS
from lightning_hdet.hdet.collapse import CollapseRule
from lightning_hdet.hdet.plateau import PlateauRule
from lightning_hdet.hdet.selection import PBTVote
from lightning_hdet.hdet.signals import SIGNALS
from lightning_hdet.hdet.trust_region import TrustRegionVote

VOTES = ("softmax", "best", "pbt", "pb2", "trust_region")
SELECTION_VOTES = ("pbt", "pb2")  # truncation selection: the bottom groups copy a top group


@dataclass(frozen=True)
class HDETConfig:
    """Every setting of :class:`~lightning_hdet.hdet.callback.HDETCallback`'s rules (documented on them), checked on
    creation.

    Errors name the argument, the value and what is allowed, before any process or process group exists.
    """

    every_n_steps: Optional[int] = None  # None: sized to the run by the callback (defaults.vote_interval)
    vote: str = "pbt"
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
    safety_net: bool = True
    divergence_factor: Optional[float] = 10.0
    rescue_lr_factor: float = 0.5
    seed: int = 0
    signal: str = "mean"
    forecast_horizon: Optional[int] = None
    curve_bins: int = 8
    quantile: float = 0.25
    resample_probability: float = 0.25
    reference_group: Optional[int] = None
    stall_patience: Optional[int] = 2
    stall_tolerance: float = 0.0
    rise_margin: Optional[float] = 1.0
    chance_loss: Optional[float] = None
    chance_tolerance: float = 0.05
    heldout_batches: int = 4
    heldout_decay: Optional[float] = None
    search_steps: Optional[int] = None
    refine_spread: float = 1.5
    plateau: Optional[PlateauRule] = PlateauRule()
    region: Optional[dict[str, float]] = None  # vote="trust_region": TrustRegionVote's options (None: its defaults)

    def __post_init__(self) -> None:
        check_int("every_n_steps", self.every_n_steps, minimum=1, optional=True,
                  hint="Optimizer steps between votes; None sizes the interval to the run's length.")
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
        check_bool("safety_net", self.safety_net)
        factor = self.divergence_factor
        require("divergence_factor", factor, factor is None or (is_finite_number(factor) and factor > 1),
                "None or a finite number > 1")
        check_number("rescue_lr_factor", self.rescue_lr_factor, 0.0, 1.0, low_open=True, high_open=True)
        check_integer("seed", self.seed)
        check_choice("signal", self.signal, SIGNALS)
        require("signal", self.signal, self.monitor is None or self.signal == "mean",
                f"'mean' when `monitor` is set (got monitor={self.monitor!r})",
                "The curve signals need every step's training loss: use `monitor=None`.")
        require("signal", self.signal, self.vote != "pb2" or self.signal != "improvement",
                "a level ('mean', 'forecast' or 'heldout') with vote='pb2'",
                "PB2 measures each group's improvement itself, from one level to the next.")
        check_int("forecast_horizon", self.forecast_horizon, minimum=1, optional=True,
                  hint="Steps from the start of an interval; None: four intervals.")
        check_int("curve_bins", self.curve_bins, minimum=2)
        check_int("heldout_batches", self.heldout_batches, minimum=1,
                  hint="Validation batches every group scores at a vote with signal='heldout'.")
        check_number("heldout_decay", self.heldout_decay, 0.0, 1.0, high_open=True, optional=True,
                     hint="None: the interval's uniform average; a float: an EMA with that decay.")
        check_int("search_steps", self.search_steps, minimum=1, optional=True,
                  hint="None searches for the whole run; N ends the search at the first vote at or after step N.")
        check_number("refine_spread", self.refine_spread, low=1.0,
                     hint="The ratio between neighbouring groups' LRs after the search (1 gives every group its LR).")
        self.selection_rule()  # validates `quantile`, `resample_probability`, `reference_group`
        self.collapse_rule()  # validates the collapse arguments
        require("plateau", self.plateau, self.plateau is None or isinstance(self.plateau, PlateauRule),
                "None or a PlateauRule", "e.g. PlateauRule(steps=200, cut=0.1); None switches the rule off.")
        require("region", self.region, self.region is None or self.vote == "trust_region",
                "None unless vote='trust_region'", "The region's options only change the trust-region vote.")
        self.trust_region_rule()  # validates the region's options

    def check_gradient_sync(self, gradient_sync: str) -> None:
        """Refuse a vote with no point under the strategy's gradient sync: the trust region's centre groups train at
        one LR, which is plain DDP at that LR only when they share one gradient (``"global"``); under ``"group"``
        they would be separate runs of the same LR, each on a fraction of the batch."""
        require("gradient_sync", gradient_sync, self.vote != "trust_region" or gradient_sync == "global",
                "'global' with vote=TrustRegion(...)",
                "Under 'group' its centre groups are separate runs at one LR, not the cheap plain-DDP run it is meant "
                "to be: pass HDETStrategy(gradient_sync='global') or another vote (e.g. 'pbt').")

    def trust_region_rule(self) -> TrustRegionVote:
        """The ``vote="trust_region"`` rule these settings describe."""
        return TrustRegionVote(**(self.region or {}))

    def selection_rule(self) -> PBTVote:
        """The ``vote="pbt"`` rule these settings describe, or ``"pb2"``'s (PBT's selection, a bandit's explore)."""
        rule = PB2Vote if self.vote == "pb2" else PBTVote
        return rule(quantile=self.quantile, resample_probability=self.resample_probability,
                    reference_group=self.reference_group)

    def collapse_rule(self) -> CollapseRule:
        """The safety net's divergence and collapse rules these settings describe."""
        return CollapseRule(factor=self.divergence_factor, patience=self.stall_patience,
                            stall_tolerance=self.stall_tolerance, rise=self.rise_margin,
                            chance_loss=self.chance_loss, chance_tolerance=self.chance_tolerance)

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded in the logger's run config under ``hdet/callback/...``."""
        return asdict(self)
