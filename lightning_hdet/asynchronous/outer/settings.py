"""The outer side's settings: the outer optimizer object, the rounds and the push checks, checked together on
creation, and the :class:`~.state.OuterState` they build. Pure: no process groups, no Lightning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_choice, check_int, require
from lightning_hdet.asynchronous.outer.checks import PushCheck, push_check_from
from lightning_hdet.asynchronous.outer.local_steps import AdaptiveSteps, LocalStepsPolicy
from lightning_hdet.asynchronous.outer.lookahead import LookaheadStep, Score
from lightning_hdet.asynchronous.outer.momentum import outer_from
from lightning_hdet.asynchronous.outer.state import OuterState, check_stagger

MODES = ("async", "sync")
DEFAULT_LOCAL_STEPS = 50


@dataclass(frozen=True)
class OuterSettings(KnownArguments):
    """The outer side's settings (the strategies' and :class:`~..elastic.service.OuterService`'s arguments of the same
    names), checked on creation; ``outer``, ``local_steps`` and ``check_pushes`` hold their objects once built."""

    mode: str = "async"
    #: An integer ``H``: every round ``H`` steps, in either mode; an :class:`~.local_steps.AdaptiveSteps`: async
    #: rounds adapted to each worker's speed; ``None`` (default): ``AdaptiveSteps()`` in async mode, 50 in DiLoCo.
    local_steps: Any = None
    #: An :class:`~.base.OuterOptimizer`, or a preset's name (:mod:`.momentum`; ``None``: ``"stable"``).
    outer: Any = None
    #: A :class:`~.checks.PushCheck`, ``True`` (its defaults) or ``False``.
    check_pushes: Any = True
    #: DiLoCo only: the model is synchronised in this many parts, one every ``local_steps / stagger`` steps.
    stagger: int = 1

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        steps = self.local_steps
        if steps is None:  # frozen: filled once, here
            object.__setattr__(self, "local_steps", AdaptiveSteps() if self.mode == "async" else DEFAULT_LOCAL_STEPS)
        elif isinstance(steps, AdaptiveSteps):
            require("local_steps", steps, self.mode == "async", "an integer H with mode='sync' (DiLoCo)",
                    f"Every DiLoCo round is H steps long, each outer step waiting for every worker. Write"
                    f" local_steps={steps.start}, or use mode='async'.")
        else:
            check_int("local_steps", steps, minimum=1, hint="An integer H fixes every round at H steps; for async"
                      " rounds adapted to each worker's speed write AdaptiveSteps(start=H), or None for the default.")
        object.__setattr__(self, "outer", outer_from(self.outer))
        object.__setattr__(self, "check_pushes", push_check_from(self.check_pushes))
        check_stagger(self.stagger, self.mode, self.rounds)
        self.outer.check(self.mode, self.stagger)

    @property
    def rounds(self) -> int:
        """``H``: every round's length, or the fastest worker's."""
        return self.local_steps.start if isinstance(self.local_steps, AdaptiveSteps) else self.local_steps

    def numbers(self) -> dict[str, Any]:
        """Every setting in force, the objects' numbers included (the run config)."""
        checks, adaptive = self.check_pushes, isinstance(self.local_steps, AdaptiveSteps)
        steps = self.local_steps.numbers() if adaptive else {}
        return {"mode": self.mode, "local_steps": self.rounds, "local_steps/adaptive": adaptive,
                **{f"local_steps/{k}": v for k, v in steps.items() if k != "start"},
                "outer": type(self.outer).__name__, **{f"outer/{k}": v for k, v in self.outer.numbers().items()},
                "check_pushes": checks is not None,
                **({f"check_pushes/{k}": v for k, v in checks.numbers().items()} if checks is not None else {}),
                "stagger": self.stagger}

    def build(self, params: Tensor, buffers: Tensor, workers: int, budget: int | None,
              ranges: list[tuple[int, int]] | None = None, parts: list[range] | None = None,
              score: Score | None = None) -> OuterState:
        """The outer state over the flat host ``params`` and ``buffers`` (the global model's start); ``ranges``:
        the fragments pushes arrive in; ``parts``: their indices by part, when staggered; ``score``: what scores
        a lookahead's candidates (required with one)."""
        params.requires_grad_(False)
        views = [params[s:e] for s, e in ranges or [(0, params.numel())]]  # leaves: params needs no grad
        outer, steps = self.outer, self.local_steps
        if isinstance(steps, AdaptiveSteps):
            policy, grace = LocalStepsPolicy(steps.start, steps.min, True, steps.smoothing), steps.grace_period
        else:
            policy, grace = LocalStepsPolicy(steps, dynamic=False), None
        check = self.check_pushes.fresh() if self.check_pushes is not None else None
        state = OuterState(params, outer.optimizer(views, self.mode, workers), policy,
                           outer.step_policy(self.mode, self.stagger, grace), budget, buffers=buffers,
                           check=check, max_rejections=check.max_rejections if check else PushCheck.MAX_REJECTIONS,
                           follows_live=outer.follows_live(self.mode), configured_buffer=outer.buffer_size,
                           parts=parts or [], lookahead=self._lookahead(score))
        state.follow_live(workers)
        return state

    def _lookahead(self, score: Score | None) -> LookaheadStep | None:
        options = self.outer.lookahead
        if options is None:
            return None
        if score is None:
            raise ValueError("`lookahead` needs a score for its candidates, and this outer side was given none: pass"
                             " `score=` to OuterSettings.build (the Lightning strategy scores with validation_step).")
        return LookaheadStep(options, score)
