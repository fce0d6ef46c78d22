"""The safety net as one rule object: its options, their checks and its judgement (pure: no Lightning, no process
groups).

:class:`SafetyNet` is what the user passes (``HDETCallback(safety_net=SafetyNet(...))``) and what the controller runs:
:meth:`SafetyNet.judge` is the divergence and collapse rules of :mod:`~lightning_hdet.hdet.rules.collapse`,
:meth:`SafetyNet.keeps` whether a merge may become the roll-back point, and ``plateau`` the plateau rule
(:class:`~lightning_hdet.hdet.rules.plateau.PlateauRule`, :mod:`~lightning_hdet.hdet.rules.plateau`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hdet._checks import KnownArguments, check_int, check_number, is_finite_number, require
from lightning_hdet.hdet.rules.collapse import CollapseHistory, Verdict, is_good, judge
from lightning_hdet.hdet.rules.plateau import PlateauRule
from lightning_hdet.hdet.rules.votes import recorded


@dataclass(frozen=True)
class SafetyNet(KnownArguments):
    """Skip the optimizer steps of a group whose loss or gradients are non-finite, restore a diverged or collapsed
    group from the others, roll every group back when all of them did (docs/hdet.md, "Safety net").

    Args:
        divergence_factor: a group whose interval loss exceeds this multiple of the best group's counts as
            diverged (positive losses only); ``None`` disables the rule.
        rescue_lr_factor: multiplier applied to a rescued group's LR (every group's when all diverged), in (0, 1).
        stall_patience: votes in a row at or above its starting level before a group counts as collapsed.
        stall_tolerance: relative margin below the starting level that still counts as no progress.
        rise_margin: a loss above ``(1 + rise_margin)`` x the group's previous interval counts as diverged, and
            all groups back at the untrained level after the ensemble's previous interval was clearly below it as
            relapsed; ``None``: neither.
        chance_loss: a constant predictor's loss (e.g. ``ln(classes)``); a group near it counts as collapsed.
        chance_tolerance: relative distance to ``chance_loss`` that counts as "near" (only with ``chance_loss``).
        plateau: "a plateau that is not learning is a failure" (:class:`~lightning_hdet.hdet.rules.plateau.PlateauRule`,
            on by default): an ensemble with no new best for ``steps`` steps (at most; a fifth of a shorter run, at
            least two votes) rolls back onto a ladder of lower LRs,
            half of it from the initial model, which the strategy then keeps as a second host copy on every rank
            (docs/hdet.md, "Safety net"); ``None`` switches it off (and that copy).
    """

    divergence_factor: Optional[float] = 10.0
    rescue_lr_factor: float = 0.5
    stall_patience: Optional[int] = 2
    stall_tolerance: float = 0.0
    rise_margin: Optional[float] = 1.0
    chance_loss: Optional[float] = None
    chance_tolerance: float = 0.05
    plateau: Optional[PlateauRule] = PlateauRule()

    def __post_init__(self) -> None:
        factor = self.divergence_factor
        require("divergence_factor", factor, factor is None or (is_finite_number(factor) and factor > 1),
                "None or a finite number > 1")
        check_number("rescue_lr_factor", self.rescue_lr_factor, 0.0, 1.0, low_open=True, high_open=True)
        check_int("stall_patience", self.stall_patience, minimum=1, optional=True,
                  hint="The number of votes in a row at or above a group's starting level; None switches it off.")
        check_number("stall_tolerance", self.stall_tolerance, 0.0, 1.0, high_open=True,
                     hint="A relative margin below the starting level that still counts as no progress.")
        check_number("rise_margin", self.rise_margin, low=0.0, low_open=True, optional=True,
                     hint="A relative margin: 1.0 flags a group whose loss doubled since its previous interval.")
        check_number("chance_loss", self.chance_loss, optional=True,
                     hint="The loss of a constant predictor, e.g. math.log(num_classes).")
        check_number("chance_tolerance", self.chance_tolerance, 0.0, 1.0, high_open=True)
        require("plateau", self.plateau, self.plateau is None or isinstance(self.plateau, PlateauRule),
                "None or a PlateauRule", "e.g. PlateauRule(steps=200, cut=0.1); None switches the rule off.")
        require("chance_tolerance", self.chance_tolerance,
                self.chance_loss is not None or self.chance_tolerance == SafetyNet.chance_tolerance,
                f"left at its default ({SafetyNet.chance_tolerance}) without `chance_loss`",
                "It only says how near `chance_loss` counts as collapsed: give SafetyNet(chance_loss=...) too.")
        require("stall_tolerance", self.stall_tolerance,
                self.stall_patience is not None or self.stall_tolerance == SafetyNet.stall_tolerance,
                f"left at its default ({SafetyNet.stall_tolerance}) with `stall_patience=None`",
                "The stall rule is off; give it a `stall_patience` or drop `stall_tolerance`.")

    def judge(self, history: CollapseHistory, losses: Sequence[float], healthy: Sequence[bool],
              progress: bool = True, errors: Optional[Sequence[float]] = None) -> Verdict:
        """Which groups count as diverged at this vote, and why (:func:`~lightning_hdet.hdet.rules.collapse.judge`)."""
        return judge(self, history, losses, healthy, progress, errors)

    def keeps(self, verdict: Verdict, losses: Sequence[float], history: CollapseHistory) -> bool:
        """Whether this vote's merged model may become the roll-back point
        (:func:`~lightning_hdet.hdet.rules.collapse.is_good`)."""
        return is_good(self, verdict, losses, history)

    def options(self) -> dict[str, Any]:
        """The options as given (the run config)."""
        return recorded(self)
