"""The outer lr chosen by a one-step lookahead (pure): at every outer update the update is tried at half, the same
and twice the current outer lr (within ``[low, high]``), each result scored on held-out data, and the best kept.
Why: no fixed outer lr comes within 5 % of the best on every workload (docs/research/2026-11-async.md, "an outer lr
chosen by a one-step lookahead"): data a run repeats want small outer steps, fresh data large ones, and a step that
overshoots or over-fits shows on held-out data at once. The score is injected (the Lightning glue scores with the
user's ``validation_step``), so the rule runs in one process in tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import KnownArguments, check_choice, check_int, check_number, require

#: The factors of the current outer lr tried at each update; a tie keeps the current lr.
SCALES = (0.5, 1.0, 2.0)
#: ``score(params, buffers)``: the held-out loss of the global model with these flat parameters and buffers.
Score = Callable[[Tensor, Tensor], float]


class OuterSide(Protocol):
    """What a lookahead steps (:class:`~.state.OuterState` is one): the global model and its outer optimizer."""

    params: Tensor
    buffers: Tensor
    optimizer: Optimizer

    def step_fragment(self, index: int, gradient: Tensor) -> None: ...


@dataclass(frozen=True)
class LookaheadLR(KnownArguments):
    """The outer lr chosen at every outer update by a one-step lookahead on the first ``batches`` of the validation
    data, an option of :class:`~.delayed_nesterov.DelayedNesterov`: ``DelayedNesterov(lr=0.375, momentum=0.5,
    warmup=16, restarts=8, lookahead=LookaheadLR())`` (the default ``"stable"`` step's numbers: ``lr`` is required;
    measured). Costs three scorings per outer update, a copy of the module on rank 0's device and about three models
    on its host. What it scores is tuned on: judge the run on other data than its first ``batches``.

    Args:
        monitor: what the ``validation_step`` logs that scores a candidate.
        mode: ``"min"`` (lower ``monitor`` is better) or ``"max"``, as in ``ModelCheckpoint``.
        batches: validation batches each candidate is scored on (the first ones, fixed for the run).
        low: the smallest outer lr the lookahead may reach.
        high: the largest.
    """

    monitor: str = "val_loss"
    mode: str = "min"
    batches: int = 8
    low: float = 0.1
    high: float = 1.0

    def __post_init__(self) -> None:
        require("monitor", self.monitor, isinstance(self.monitor, str) and bool(self.monitor),
                "the name of a metric your validation_step logs", "e.g. monitor='val_loss'.")
        check_choice("mode", self.mode, ("min", "max"), hint="As ModelCheckpoint's: which way monitor is better.")
        check_int("batches", self.batches, minimum=1, hint="Validation batches scored per candidate outer lr.")
        check_number("low", self.low, low=0, low_open=True)
        check_number("high", self.high, low=self.low, hint=f"(at least low={self.low})")

    def numbers(self) -> dict[str, Any]:
        """Every option in force, by name (the run config)."""
        return {"monitor": self.monitor, "mode": self.mode, "batches": self.batches, "low": self.low,
                "high": self.high}

    def check_lr(self, lr: float) -> None:
        """The outer optimizer's own ``lr``, where the lookahead starts, lies in ``[low, high]``."""
        require("lr", lr, self.low <= lr <= self.high, f"within the lookahead's [low, high] = [{self.low:g},"
                f" {self.high:g}]", "The lookahead starts at the outer lr given; widen low/high or move lr.")


def refuse_lookahead(outer: Any, where: str, why: str) -> None:
    """Refuse an outer optimizer with a lookahead where nothing can score its candidates (``where``)."""
    require("outer", outer, getattr(outer, "lookahead", None) is None, f"an outer optimizer without lookahead with"
            f" {where}", f"{why} Remove lookahead=..., or train with AsyncLocalSGDStrategy (docs/async.md).")


class LookaheadStep:
    """One outer update at the lr a lookahead picks: each candidate is applied, scored and undone (parameters and
    optimizer state restored exactly), then the best candidate's lr is set and the update applied for good."""

    def __init__(self, options: LookaheadLR, score: Score) -> None:
        self.options, self.score = options, score
        self.scores: list[float] = []  # the latest update's, one per SCALES entry
        self._lr: float | None = None  # the lr in force, never a candidate's (read while candidates are tried)

    def lr(self, outer: OuterSide) -> float:
        """The outer lr in force (the first parameter group's: the lookahead moves every group by one factor)."""
        return self._lr if self._lr is not None else float(outer.optimizer.param_groups[0]["lr"])

    def step(self, outer: OuterSide, fragments: Sequence[tuple[int, Tensor]]) -> None:
        """Apply one outer update made of ``fragments`` (fragment index, pseudo-gradient) at the best candidate lr."""
        base = [group["lr"] for group in outer.optimizer.param_groups]
        self._lr, saved, self.scores = base[0], _snapshot(outer), []
        for scale in SCALES:
            try:
                self._apply(outer, fragments, base, scale)
                loss = float(self.score(outer.params, outer.buffers))
            finally:  # a score that raises leaves the model and the lr as they were
                _restore(outer, saved, base)
            self.scores.append(loss if math.isfinite(loss) else math.inf)
        # lowest score; a tie (or every candidate non-finite) keeps the current lr
        best = min(range(len(SCALES)), key=lambda i: (self.scores[i], abs(math.log(SCALES[i]))))
        self._apply(outer, fragments, base, SCALES[best])
        self._lr = float(outer.optimizer.param_groups[0]["lr"])

    def _apply(self, outer: OuterSide, fragments: Sequence[tuple[int, Tensor]], base: list[float],
               scale: float) -> None:
        low, high = self.options.low, self.options.high
        for group, lr in zip(outer.optimizer.param_groups, base):
            group["lr"] = min(high, max(low, lr * scale))
        for index, gradient in fragments:
            outer.step_fragment(index, gradient)


def _snapshot(outer: OuterSide) -> tuple[Tensor, dict[Any, dict[str, Any]]]:
    """The global parameters and the outer optimizer's state, copied."""
    state = {p: {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
             for p, s in outer.optimizer.state.items()}
    return outer.params.clone(), state


def _restore(outer: OuterSide, saved: tuple[Tensor, dict[Any, dict[str, Any]]], lrs: list[float]) -> None:
    """Undo a candidate: the parameters, the lrs and a fresh copy of the saved optimizer state (a candidate may have
    created state the snapshot lacks, e.g. the first momentum buffer)."""
    params, state = saved
    outer.params.copy_(params)
    for group, lr in zip(outer.optimizer.param_groups, lrs):
        group["lr"] = lr
    outer.optimizer.state.clear()
    for p, s in state.items():
        outer.optimizer.state[p] = {k: v.clone() if isinstance(v, Tensor) else v for k, v in s.items()}
