"""What a push must be before the outer optimizer applies it (pure; ``docs/failure_modes.md``, "A worker goes bad"):
the right fragments and buffers (``float32``, finite), finite norms, and a norm at most ``max_norm_ratio`` times the
larger of this worker's and everyone's recent median for pushes of the same part (once ``min_history`` were
accepted). A median follows schedules and ignores one odd push; the multiple lets a longer round or a loss spike
through, refusing only an order-of-magnitude outlier. Staggered parts and whole-model goodbyes keep their own
histories. ``max_rejections`` rejections in a row (a worker's own discarded rounds included) exclude the worker.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch
from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_int, check_number, require

#: Reasons a push is rejected (logged, and counted in ``async/worker{i}/rejected``).
DISCARDED_BY_WORKER = "discarded by the worker (its local steps went non-finite)"


@dataclass(eq=True)
class PushCheck(KnownArguments):
    """The checks on arriving pushes (``check_pushes=PushCheck(...)``) and the recent accepted norms they compare
    with (each run holds a :meth:`fresh` copy).

    Args:
        max_norm_ratio: a push whose norm exceeds this multiple of the reference median is rejected.
        max_rejections: rejections in a row after which a worker is excluded.
        window: accepted norms kept, per worker and overall, for each part (``-1``: the whole model).
        min_history: accepted pushes (overall, of the same part) before the norm rule applies.
    """

    MAX_NORM_RATIO: ClassVar[float] = 10.0
    MAX_REJECTIONS: ClassVar[int] = 3
    max_norm_ratio: float = MAX_NORM_RATIO
    max_rejections: int = MAX_REJECTIONS
    window: int = 32
    min_history: int = 4
    _all: dict[int, deque[float]] = field(default_factory=dict, init=False, repr=False, compare=False)  # by part
    _own: dict[tuple[int, int], deque[float]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_number("max_norm_ratio", self.max_norm_ratio, low=1, low_open=True,
                     hint="A push is refused when its norm exceeds this multiple of the recent median.")
        check_int("max_rejections", self.max_rejections, minimum=1,
                  hint="A worker whose pushes are rejected this many times in a row stops.")
        check_int("window", self.window, minimum=1)
        check_int("min_history", self.min_history, minimum=1)

    def numbers(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def fresh(self) -> PushCheck:
        return replace(self)  # the same options, no history

    def limit(self, worker: int, part: int = -1) -> float:
        """The largest norm ``worker``'s next push of ``part`` may have (``inf`` until the rule applies)."""
        everyone = self._all.get(part, ())
        if len(everyone) >= self.min_history:
            reference = statistics.median(everyone)
        elif part == -1:  # a staggered run's goodbye: few whole-model pushes, but its parts' norms add in squares
            reference = math.sqrt(sum(statistics.median(d) ** 2 for p, d in self._all.items()
                                      if p >= 0 and len(d) >= self.min_history))
            if reference == 0:
                return math.inf  # no part has history yet either
        else:
            return math.inf
        own = self._own.get((worker, part))
        if own:
            reference = max(reference, statistics.median(own))
        return self.max_norm_ratio * reference if reference > 0 else math.inf

    def accepted(self, worker: int, norm: float, part: int = -1) -> None:
        self._all.setdefault(part, deque(maxlen=self.window)).append(norm)
        self._own.setdefault((worker, part), deque(maxlen=self.window)).append(norm)

    def inspect(self, worker: int, fragments: Iterable[Tensor], ranges: Sequence[tuple[int, int]],
                stage: Tensor | None, part: int = -1) -> tuple[str | None, list[Tensor], float]:
        """Read, check and keep every fragment (copied into ``stage`` if given); ``(reason, kept, norm)``."""
        reason, kept, squares = None, [], 0.0
        for index, fragment in enumerate(fragments):
            if reason is not None:
                continue
            reason = _form(index, fragment, ranges)
            if reason is None:
                norm = float(torch.linalg.vector_norm(fragment))  # the one reduction of this fragment
                if not math.isfinite(norm):
                    reason = f"non-finite values in fragment {index}"
                squares += norm * norm
                if stage is not None:
                    start, end = ranges[index]
                    fragment = stage[start:end].copy_(fragment)
                kept.append(fragment)
        if reason is None and kept and len(kept) != len(ranges):
            reason = f"{len(kept)} fragments, the layout has {len(ranges)}"
        norm = math.sqrt(squares)
        limit = self.limit(worker, part)
        if reason is None and kept and not norm <= limit:
            of = f" of part {part}'s pushes" if part >= 0 else ""
            reason = f"norm {norm:.4g} above {self.max_norm_ratio:g} x the recent median{of} (limit {limit:.4g})"
        return reason, kept, norm


def buffers_problem(buffers: Tensor | None, n_buffers: int) -> str | None:
    """What is wrong with a push's buffer values (``None``: nothing)."""
    if buffers is None:
        return None
    if buffers.dtype != torch.float32 or buffers.numel() != n_buffers:
        return f"buffers are {buffers.dtype}[{buffers.numel()}], expected torch.float32[{n_buffers}]"
    return None if bool(torch.isfinite(buffers).all()) else "non-finite buffer values"


def _form(index: int, fragment: Tensor, ranges: Sequence[tuple[int, int]]) -> str | None:
    if index >= len(ranges):
        return f"more fragments than the layout's {len(ranges)}"
    size = ranges[index][1] - ranges[index][0]
    if fragment.dtype != torch.float32:
        return f"fragment {index} is {fragment.dtype}, expected torch.float32"
    if fragment.dim() != 1 or fragment.numel() != size:
        return f"fragment {index} has shape {tuple(fragment.shape)}, expected ({size},)"
    return None


def push_check_from(value: object) -> PushCheck | None:
    """``check_pushes``: a :class:`PushCheck`, ``True`` (``PushCheck()``) or ``False`` (nothing checked)."""
    if isinstance(value, PushCheck):
        return value
    require("check_pushes", value, isinstance(value, bool), "True, False or a PushCheck(max_norm_ratio, max_rejections)")
    return PushCheck() if value else None
