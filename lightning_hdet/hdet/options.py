"""HDETCallback's rules as objects: each option lives on the rule it changes (pure: no Lightning, no process groups).

As Ray Tune takes a scheduler object, :class:`~lightning_hdet.hdet.callback.HDETCallback` takes

* a **vote** (:class:`PBT`, :class:`Softmax`, :class:`Best`, :class:`TrustRegion`, or their names ``"pbt"``,
  ``"softmax"``, ``"best"``, ``"trust_region"``), with the vote's own options on it; the votes that blend parameters
  (``Softmax``, ``Best``, ``TrustRegion``) carry ``blend``;
* a **search** (:class:`Search`, ``True`` for its defaults, ``False`` to vote the whole run without ending it);
* a **safety net** (:class:`SafetyNet`, ``True`` for its defaults, ``False`` to switch it off), with the plateau
  rule (:class:`~lightning_hdet.hdet.plateau.PlateauRule`) as its option ``plateau``;
* a **signal** (``"mean"``; research signals live in :mod:`lightning_hdet.experimental`).

Every object is a frozen dataclass checked on creation: an option that does not exist for a rule is a
``TypeError`` from the constructor, and a value outside its range raises the package's standard ``ValueError``
before any process exists. :func:`resolve` turns them into the flat, internal :class:`~lightning_hdet.hdet.config.HDETConfig`
the controller reads. Options measured as not helping are in :mod:`lightning_hdet.experimental` (built on
:class:`Vote` and :class:`Signal` here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Optional, Union

from lightning_hdet._checks import require
from lightning_hdet.hdet.config import HDETConfig
from lightning_hdet.hdet.plateau import PlateauRule


class Vote:
    """Base of the vote rules: ``settings()`` is what the rule sets in :class:`HDETConfig`."""

    name: ClassVar[str] = ""

    def settings(self) -> dict[str, Any]:
        """This rule's fields as :class:`HDETConfig` fields (``vote`` names the rule)."""
        return {"vote": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        HDETConfig(**self.settings())  # the one place every value is checked (errors name the argument)


@dataclass(frozen=True)
class PBT(Vote):
    """Population-based training's truncation selection (the default vote, it searches): at each vote the bottom
    ``quantile`` of groups copies a top group's parameters and takes its LR x0.8 / x1.2, or with probability
    ``resample_probability`` a fresh log-uniform one (Ray Tune's defaults). Copies, never blends.

    Args:
        quantile: share of groups that move (bottom) and are copied (top), in (0, 0.5].
        resample_probability: chance of a fresh LR instead of x0.8 / x1.2, in [0, 1].
    """

    name: ClassVar[str] = "pbt"
    quantile: float = 0.25
    resample_probability: float = 0.25


@dataclass(frozen=True)
class Softmax(Vote):
    """The published auto-LR controller (ALGORITHMS.md §1.1): softmax weights of the losses move the base LR with
    momentum; every group then blends toward ``blend``.

    Args:
        temperature: softmax temperature, in the loss's own units (published 0.1; pick about the spread of the
            groups' losses you consider meaningful).
        momentum: momentum of the controller's velocity (published 0.9).
        meta_lr: how far the base LR moves per unit of velocity (published 0.5).
        permute: give the groups a fresh random permutation of the multipliers after each vote.
        blend: merge target: ``"mean"`` (published), ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "softmax"
    temperature: float = 0.1
    momentum: float = 0.9
    meta_lr: float = 0.5
    permute: bool = True
    blend: str = "mean"


@dataclass(frozen=True)
class Best(Vote):
    """The lowest-loss group wins; every other group is re-centred on its LR, the log-spread narrowing by ``shrink``
    each vote down to ``min_spread``; every group then blends toward ``blend``.

    Args:
        shrink: factor by which the log-spread of multipliers narrows each vote, in (0, 1].
        min_spread: floor of that log-spread (> 0: variation is never lost).
        blend: merge target: ``"mean"``, ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "best"
    shrink: float = 0.5
    min_spread: float = 0.05
    blend: str = "mean"


@dataclass(frozen=True)
class TrustRegion(Vote):
    """A trust region of LRs around one incumbent (:mod:`~lightning_hdet.hdet.trust_region`): two edge groups probe
    ``incumbent / r`` and ``incumbent * r``, the others train at the incumbent; a winning edge moves the incumbent
    (twice in a row: ``r`` grows), the centre winning shrinks ``r``. Cheap when the LR is right only if the centre
    groups share one gradient, so it needs ``HDETStrategy(gradient_sync="global")`` (refused with ``"group"``).

    Args:
        ratio: the starting ``r`` (> 1, within ``[min_ratio, max_ratio]``).
        grow: factor on ``log r`` when the same edge wins twice in a row (>= 1).
        shrink: factor on ``log r`` when the centre wins, in (0, 1].
        min_ratio: the smallest ``r`` (> 1: the edges never merge with the centre).
        max_ratio: the largest ``r`` (>= ``min_ratio``).
        blend: merge target: ``"mean"``, ``"weighted"`` (vote weights) or ``"best"`` (the winner).
    """

    name: ClassVar[str] = "trust_region"
    ratio: float = 2.0
    grow: float = 2.0
    shrink: float = 0.5
    min_ratio: float = 1.1
    max_ratio: float = 10.0
    blend: str = "mean"

    def settings(self) -> dict[str, Any]:
        # Its options are one field of HDETConfig: `shrink` there is Best's.
        region = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "blend"}
        return {"vote": self.name, "blend": self.blend, "region": region}


class Signal:
    """Base of what a vote compares; ``"mean"`` (each group's mean training loss over the interval) is the one
    recommended, the others are in :mod:`lightning_hdet.experimental`."""

    name: ClassVar[str] = "mean"

    def settings(self) -> dict[str, Any]:
        return {"signal": self.name}

    def __post_init__(self) -> None:
        HDETConfig(**self.settings())  # (dataclass subclasses: every value checked on creation)

    def scorer(self) -> Any:
        """What scores each group besides its training curve (``None``: nothing; see ``experimental.Heldout``)."""
        return None


@dataclass(frozen=True)
class Search:
    """End the search and train around what it found, in the same run (docs/hdet.md, "search, then train").

    At the first vote at or after step ``steps`` whose winner is below its first step's loss, every group takes
    the winner's model (and a fresh optimizer state), the LRs become a grid of ratio ``refine_spread`` around the
    winner's, and gradients are averaged over all ranks from then on (``gradient_sync="global"``).

    Args:
        steps: the step at which the search may end; ``None``: a quarter of the run, ``trainer.max_steps // 4``
            (or of the estimated optimizer steps of a run bounded by epochs), searched the whole run when the
            run's length is unknown.
        refine_spread: the ratio between neighbouring groups' LRs once the search ended (>= 1).
    """

    steps: Optional[int] = None
    refine_spread: float = 1.5

    def __post_init__(self) -> None:
        HDETConfig(search_steps=self.steps, refine_spread=self.refine_spread)


@dataclass(frozen=True)
class SafetyNet:
    """Skip the optimizer steps of a group whose loss or gradients are non-finite, restore a diverged or collapsed
    group from the others, roll every group back when all of them did (docs/hdet.md, "Safety net").

    Args:
        divergence_factor: a group whose interval loss exceeds this multiple of the best group's counts as
            diverged (positive losses only); ``None`` disables the rule.
        rescue_lr_factor: multiplier applied to a rescued group's LR (every group's when all diverged), in (0, 1).
        stall_patience: votes in a row at or above its starting level before a group counts as collapsed.
        stall_tolerance: relative margin below the starting level that still counts as no progress.
        rise_margin: a loss above ``(1 + rise_margin)`` x the group's previous interval counts as diverged.
        chance_loss: a constant predictor's loss (e.g. ``ln(classes)``); a group near it counts as collapsed.
        chance_tolerance: relative distance to ``chance_loss`` that counts as "near" (only with ``chance_loss``).
        plateau: "a plateau that is not learning is a failure" (:class:`~lightning_hdet.hdet.plateau.PlateauRule`,
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
        require("chance_tolerance", self.chance_tolerance,
                self.chance_loss is not None or self.chance_tolerance == SafetyNet.chance_tolerance,
                f"left at its default ({SafetyNet.chance_tolerance}) without `chance_loss`",
                "It only says how near `chance_loss` counts as collapsed: give SafetyNet(chance_loss=...) too.")
        require("stall_tolerance", self.stall_tolerance,
                self.stall_patience is not None or self.stall_tolerance == SafetyNet.stall_tolerance,
                f"left at its default ({SafetyNet.stall_tolerance}) with `stall_patience=None`",
                "The stall rule is off; give it a `stall_patience` or drop `stall_tolerance`.")
        HDETConfig(**self.settings())

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


VOTES: dict[str, type[Vote]] = {"pbt": PBT, "softmax": Softmax, "best": Best, "trust_region": TrustRegion}


def as_vote(vote: Union[str, Vote]) -> Vote:
    """``vote`` as a rule object: a name of :data:`VOTES` gives that rule with its defaults."""
    if isinstance(vote, Vote):
        return vote
    require("vote", vote, isinstance(vote, str) and vote in VOTES,
            f"one of {tuple(VOTES)} or a Vote object (PBT(...), Softmax(...), Best(...), TrustRegion(...))")
    return VOTES[vote]()


def as_signal(signal: Union[str, Signal]) -> Signal:
    """``signal`` as an object: ``"mean"`` or an experimental :class:`Signal`."""
    if isinstance(signal, Signal):
        return signal
    require("signal", signal, signal == "mean", "'mean' or a Signal object (see lightning_hdet.experimental)")
    return Signal()


def _as_rule(name: str, value: Any, rule: type) -> Optional[Any]:
    """``True``: the rule with its defaults; ``False``: none; a ``rule`` object as it is."""
    if isinstance(value, rule):
        return value
    require(name, value, isinstance(value, bool), f"True, False or a {rule.__name__}(...) object")
    return rule() if value else None


def resolve(
    every_n_steps: Optional[int],
    vote: Union[str, Vote],
    search: Union[bool, Search],
    safety_net: Union[bool, SafetyNet],
    monitor: Optional[str],
    signal: Union[str, Signal],
    warmup_steps: int,
    seed: int,
) -> tuple[HDETConfig, Optional[Search], Signal]:
    """The callback's arguments as one validated :class:`HDETConfig`, the search (``None``: none) and the signal."""
    rule, kind = as_vote(vote), as_signal(signal)
    search_rule = _as_rule("search", search, Search)
    net = _as_rule("safety_net", safety_net, SafetyNet)
    config = HDETConfig(
        every_n_steps=every_n_steps, monitor=monitor, warmup_steps=warmup_steps, seed=seed,
        safety_net=net is not None, **(net or SafetyNet()).settings(), **rule.settings(), **kind.settings(),
        **({"search_steps": search_rule.steps, "refine_spread": search_rule.refine_spread} if search_rule else {}),
    )
    return config, search_rule, kind
