"""The outer side's settings: the outer optimizer object, the rounds and the push checks, checked together on
creation, and the :class:`~.state.OuterState` they build. Pure: no process groups, no Lightning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_choice, check_number
from lightning_hdet.asynchronous.outer.checks import PushCheck, push_check_from
from lightning_hdet.asynchronous.outer.local_steps import LocalStepsPolicy, validate_local_steps
from lightning_hdet.asynchronous.outer.momentum import outer_from
from lightning_hdet.asynchronous.outer.state import OuterState, check_stagger

MODES = ("async", "sync")
#: The options only async mode uses, and their defaults there.
ASYNC_ONLY: dict[str, Any] = {"dynamic_local_steps": True, "grace_period": 0.0}
_WHY_NOT_SYNC = {
    "dynamic_local_steps": "every round is `local_steps` long, since each outer step waits for every worker.",
    "grace_period": "each outer step already waits for every worker's push.",
}


@dataclass(frozen=True)
class OuterSettings(KnownArguments):
    """The outer side's settings (the strategies' and :class:`~..elastic.service.OuterService`'s arguments of the same
    names), checked on creation: the outer optimizer object, the rounds, the push checks."""

    mode: str = "async"
    local_steps: int = 50
    #: An :class:`~.base.OuterOptimizer`, or a preset's name (:mod:`.momentum`; ``None``: ``"stable"``): the object.
    outer: Any = None
    min_local_steps: int = 1
    #: Async only (``None``: True in async mode; refused with DiLoCo, whose rounds are all ``local_steps`` long).
    dynamic_local_steps: bool | None = None
    #: Async only (``None``: 0.0 in async mode; refused with DiLoCo, which always waits for every worker).
    grace_period: float | None = None
    speed_smoothing: float = 0.5
    #: A :class:`~.checks.PushCheck`, ``True`` (its defaults) or ``False``: once built, the object or ``None``.
    check_pushes: Any = True
    #: DiLoCo only: the model is synchronised in this many parts, one every ``local_steps / stagger`` steps.
    stagger: int = 1

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        for name, default in ASYNC_ONLY.items():
            value = getattr(self, name)
            if self.mode == "sync" and value is not None:  # recorded as in force while doing nothing: refused
                raise ValueError(f"`{name}={value!r}` has no effect with mode='sync' (DiLoCo): {_WHY_NOT_SYNC[name]}"
                                 f" Remove it, or use mode='async'.")
            if self.mode == "async" and value is None:
                object.__setattr__(self, name, default)  # frozen: filled once, here
        object.__setattr__(self, "outer", outer_from(self.outer))
        object.__setattr__(self, "check_pushes", push_check_from(self.check_pushes))
        validate_local_steps(self.local_steps, self.min_local_steps, self.speed_smoothing)
        check_stagger(self.stagger, self.mode, self.local_steps)
        if self.grace_period is not None:
            check_number("grace_period", self.grace_period, low=0, hint="It is in seconds; 0 applies each push alone.")
        self.outer.check(self.mode, self.stagger)

    def numbers(self) -> dict[str, Any]:
        """Every setting in force, the objects' numbers included (the run config)."""
        checks = self.check_pushes
        return {"mode": self.mode, "local_steps": self.local_steps, "outer": type(self.outer).__name__,
                **{f"outer/{k}": v for k, v in self.outer.numbers().items()}, "min_local_steps": self.min_local_steps,
                "dynamic_local_steps": self.dynamic_local_steps, "grace_period": self.grace_period,
                "speed_smoothing": self.speed_smoothing, "check_pushes": checks is not None,
                **({f"check_pushes/{k}": v for k, v in checks.numbers().items()} if checks is not None else {}),
                "stagger": self.stagger}

    def build(self, params: Tensor, buffers: Tensor, workers: int, budget: int | None,
              ranges: list[tuple[int, int]] | None = None, parts: list[range] | None = None) -> OuterState:
        """The outer state over the flat host tensors ``params`` and ``buffers`` (the global model's start): the
        outer optimizer object's ``torch.optim.Optimizer`` and step policy. ``ranges``: the fragments pushes arrive
        in (default: one); ``parts``: their indices by part, when staggered (:attr:`~.messages.Fragments.parts`)."""
        params.requires_grad_(False)
        views = [params[s:e] for s, e in ranges or [(0, params.numel())]]  # leaves: params needs no grad
        outer, is_async = self.outer, self.mode == "async"
        policy = LocalStepsPolicy(self.local_steps, self.min_local_steps, bool(self.dynamic_local_steps) and is_async,
                                  self.speed_smoothing)
        check = self.check_pushes.fresh() if self.check_pushes is not None else None
        state = OuterState(params, outer.optimizer(views, self.mode, workers), policy,
                           outer.step_policy(self.mode, self.stagger, self.grace_period), budget, buffers=buffers,
                           check=check, max_rejections=check.max_rejections if check else PushCheck.MAX_REJECTIONS,
                           follows_live=outer.follows_live(self.mode), configured_buffer=outer.buffer_size,
                           parts=parts or [])
        state.follow_live(workers)
        return state


