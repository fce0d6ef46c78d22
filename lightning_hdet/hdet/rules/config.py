"""HDETCallback's rules as given and the settings that belong to no rule, in one checked value (pure: no Lightning,
no process groups).

The rules are the user's objects (:mod:`~lightning_hdet.hdet.rules.options`), kept as they are: each checked its own
options on creation and carries its own behaviour, so nothing here copies an option of a rule. What is left is when
the votes happen and what they read (``every_n_steps``, ``monitor``, ``warmup_steps``, ``seed``) and the checks of
one rule against another (a curve signal needs the training loss, not ``monitor``; a vote may refuse a signal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from lightning_hdet._checks import check_int, check_integer, require
from lightning_hdet.hdet.rules.options import PBT, SafetyNet, Search, Signal, Vote, as_rule, as_signal, as_vote


@dataclass(frozen=True)
class HDETConfig:
    """:class:`~lightning_hdet.hdet.lightning.callback.HDETCallback`'s rules and settings (documented there), checked on
    creation: errors name the argument, the value and what is allowed, before any process or process group exists.

    ``search`` and ``safety_net`` are ``None`` when switched off."""

    vote: Vote = field(default_factory=PBT)
    search: Optional[Search] = None
    safety_net: Optional[SafetyNet] = field(default_factory=SafetyNet)
    signal: Signal = field(default_factory=Signal)
    every_n_steps: Optional[int] = None  # None: sized to the run by the callback (defaults.vote_interval)
    monitor: Optional[str] = None
    warmup_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        require("vote", self.vote, isinstance(self.vote, Vote), "a Vote object (PBT(...), Softmax(...), ...)")
        require("search", self.search, self.search is None or isinstance(self.search, Search), "None or a Search")
        require("safety_net", self.safety_net, self.safety_net is None or isinstance(self.safety_net, SafetyNet),
                "None or a SafetyNet")
        require("signal", self.signal, isinstance(self.signal, Signal), "a Signal object")
        check_int("every_n_steps", self.every_n_steps, minimum=1, optional=True,
                  hint="Optimizer steps between votes; None sizes the interval to the run's length.")
        require("monitor", self.monitor, self.monitor is None or (isinstance(self.monitor, str) and self.monitor != ""),
                "None or a logged metric name")
        check_int("warmup_steps", self.warmup_steps, minimum=0)
        check_integer("seed", self.seed)
        require("signal", self.signal.name, self.monitor is None or type(self.signal) is Signal,
                f"'mean' when `monitor` is set (got monitor={self.monitor!r})",
                "The curve signals need every step's training loss: use `monitor=None`.")
        require("search", self.search, self.monitor is None or self.search is None or self.search.evidence is None,
                f"a Search without `evidence` when the votes read `monitor` (got monitor={self.monitor!r})",
                "`evidence` weighs the training-loss curves, which a vote on a validation metric does not read "
                "(monitor='auto' picks `val_loss` where the data repeat): drop `evidence`, or pass monitor=None.")
        self.vote.check_signal(self.signal)

    def as_dict(self) -> dict[str, Any]:
        """The settings as recorded in the logger's run config under ``hdet/callback/...``: each rule's options
        under its own key (``None``: switched off)."""
        return {"every_n_steps": self.every_n_steps, "monitor": self.monitor, "warmup_steps": self.warmup_steps,
                "seed": self.seed, "vote": self.vote.options(), "signal": self.signal.options(),
                "search": self.search.options() if self.search else None,
                "safety_net": self.safety_net.options() if self.safety_net else None}


def resolve(
    every_n_steps: Optional[int],
    vote: Union[str, Vote],
    search: Union[bool, Search],
    safety_net: Union[bool, SafetyNet],
    monitor: Optional[str],
    signal: Union[str, Signal],
    warmup_steps: int,
    seed: int,
) -> HDETConfig:
    """The callback's arguments (names and ``True``/``False`` allowed) as one checked :class:`HDETConfig`."""
    return HDETConfig(vote=as_vote(vote), search=as_rule("search", search, Search),
                      safety_net=as_rule("safety_net", safety_net, SafetyNet), signal=as_signal(signal),
                      every_n_steps=every_n_steps, monitor=monitor, warmup_steps=warmup_steps, seed=seed)
