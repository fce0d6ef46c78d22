"""HDETCallback's rules as objects: each option lives on the rule it changes (pure: no Lightning, no process groups).

As Ray Tune takes a scheduler object, :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` takes

* a **vote** (:class:`PBT`, :class:`Softmax`, :class:`Best`, :class:`TrustRegion`, or their names ``"pbt"``,
  ``"softmax"``, ``"best"``, ``"trust_region"``), with the vote's own options on it; the votes that blend parameters
  (``Softmax``, ``Best``, ``TrustRegion``) carry ``blend``;
* a **search** (:class:`Search`, ``True`` for its defaults, ``False`` to vote the whole run without ending it);
* a **safety net** (:class:`SafetyNet`, ``True`` for its defaults, ``False`` to switch it off), with the plateau
  rule (:class:`~lightning_hdet.hdet.rules.plateau.PlateauRule`) as its option ``plateau``;
* a **signal** (``"mean"``).

Every object is a frozen dataclass checked on creation: an option that does not exist for a rule is a
``TypeError`` from the constructor, and a value outside its range raises the package's standard ``ValueError``
before any process exists. Each is also the code that runs: the votes' ``explore`` (:mod:`~lightning_hdet.hdet.rules.votes`,
:mod:`~lightning_hdet.hdet.rules.selection`, :mod:`~lightning_hdet.hdet.rules.trust_region`), the safety net's ``judge``
(:mod:`~lightning_hdet.hdet.rules.safety_net`), the signal's ``scores``; the controller takes them as they are
(:class:`~lightning_hdet.hdet.rules.config.HDETConfig`). Research options are in
:mod:`lightning_hdet.experimental` (built on :class:`Vote`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

from lightning_hdet._checks import KnownArguments, check_choice, check_int, check_number, require
from lightning_hdet.hdet.rules.defaults import RESTART_BELOW
from lightning_hdet.hdet.rules.safety_net import SafetyNet
from lightning_hdet.hdet.rules.selection import PBT
from lightning_hdet.hdet.rules.signals import CURVE_BINS
from lightning_hdet.hdet.rules.trust_region import TrustRegion
from lightning_hdet.hdet.rules.votes import Best, Softmax, Vote, recorded

if TYPE_CHECKING:
    from lightning_hdet.hdet.rules.controller import Interval

__all__ = ["Best", "PBT", "SafetyNet", "Search", "Signal", "Softmax", "TrustRegion", "Vote", "as_vote",
           "as_signal", "as_rule"]


@dataclass(frozen=True)
class Signal(KnownArguments):
    """What a vote compares: each group's mean training loss over the interval (``"mean"``).

    A subclass says what it scores (:meth:`scores`) and how many ``bins`` of the interval's loss curve the callback
    keeps on the device."""

    name: ClassVar[str] = "mean"
    bins = CURVE_BINS

    def scores(self, interval: Interval, every: int) -> Optional[list[float]]:
        """Every group's score at this vote (lower is better); ``None``: the interval's losses themselves."""
        return None

    def options(self) -> dict[str, Any]:
        """The options as given (the run config)."""
        return {"name": self.name, **recorded(self)}


@dataclass(frozen=True)
class Search(KnownArguments):
    """End the search and train around what it found, in the same run (docs/hdet.md, "search, then train").

    At the first vote at or after step ``steps`` whose winner is below its first step's loss, every group takes
    the winner's model (and a fresh optimizer state), the LRs become a grid of ratio ``refine_spread`` around the
    winner's, and gradients are averaged over all ranks from then on (``gradient_sync="global"``). Where the
    winner's LR is at most ``restart_below`` times the optimizer's, every group restarts from the initial model
    instead: weights trained at a far higher LR went on training slowly (docs/hdet.md, "search, then train").
    With ``evidence``, a vote of the search before step ``steps`` also ends it once every group whose LR the grid
    leaves out lost to the winner by more than ``evidence`` standard errors (:mod:`~.search_end`).

    Args:
        steps: the step at which the search may end; ``None``: a quarter of the run, ``trainer.max_steps // 4``
            (or of the estimated optimizer steps of a run bounded by epochs), searched the whole run when the
            run's length is unknown.
        refine_spread: the ratio between neighbouring groups' LRs once the search ended (>= 1).
        restart_below: the winner's LR multiplier (of the first param group) at or below which the groups restart
            from the initial model, in (0, 1]; ``None``: never. A fresh run only (a resumed one holds no initial
            model; it warns and trains on from the winner's).
        evidence: standard errors by which every group outside the grid the search ends on must have lost to the
            winner for a vote before ``steps`` to end the search (> 0); ``None``: it ends at ``steps`` only. Needs
            the training-loss curves (not with ``monitor``).
    """

    steps: Optional[int] = None
    refine_spread: float = 1.5
    restart_below: Optional[float] = RESTART_BELOW
    evidence: Optional[float] = None

    def __post_init__(self) -> None:
        check_int("search_steps", self.steps, minimum=1, optional=True,
                  hint="None searches for the whole run; N ends the search at the first vote at or after step N.")
        check_number("refine_spread", self.refine_spread, low=1.0,
                     hint="The ratio between neighbouring groups' LRs after the search (1 gives every group its LR).")
        check_number("restart_below", self.restart_below, 0.0, 1.0, low_open=True, optional=True,
                     hint="A fraction of the optimizer's LR, e.g. 1/3; None never restarts from the initial model.")
        check_number("evidence", self.evidence, low=0.0, low_open=True, optional=True,
                     hint="Standard errors, e.g. 2.5; None ends the search at `steps` only.")

    def options(self) -> dict[str, Any]:
        """The options as given (the run config)."""
        return recorded(self)


VOTES: dict[str, type[Vote]] = {"pbt": PBT, "softmax": Softmax, "best": Best, "trust_region": TrustRegion}


def as_vote(vote: Union[str, Vote]) -> Vote:
    """``vote`` as a rule object: a name of :data:`VOTES` gives that rule with its defaults."""
    if isinstance(vote, Vote):
        return vote
    check_choice("vote", vote, tuple(VOTES),
                 other="a Vote object (PBT(...), Softmax(...), Best(...), TrustRegion(...))")
    return VOTES[vote]()


def as_signal(signal: Union[str, Signal]) -> Signal:
    """``signal`` as an object: ``"mean"`` or a :class:`Signal`."""
    if isinstance(signal, Signal):
        return signal
    check_choice("signal", signal, ("mean",), other="a Signal object")
    return Signal()


def as_rule(name: str, value: Any, rule: type) -> Optional[Any]:
    """``True``: the rule with its defaults; ``False``: none; a ``rule`` object as it is."""
    if isinstance(value, rule):
        return value
    require(name, value, isinstance(value, bool), f"True, False or a {rule.__name__}(...) object")
    return rule() if value else None
