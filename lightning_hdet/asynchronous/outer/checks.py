"""What a push must be before the outer optimizer applies it. Pure: no process groups, no Lightning.

One worker with a bad batch, an overflow or a faulty device must not poison the global model that every other
worker trains from. Rank 0's server and the elastic :class:`~.elastic.service.OuterService` therefore look at every
push before any of it is applied (``docs/failure_modes.md``, "A worker goes bad"):

* **form**: as many fragments as the layout has, each a flat ``float32`` tensor of its fragment's size; the
  floating-point buffer values the right size, ``float32`` and finite;
* **finite**: every fragment's norm (one reduction per fragment, no copy: NaN or Inf anywhere makes it NaN or
  Inf) is finite;
* **norm**: the push's pseudo-gradient norm is at most ``max_norm_ratio`` times the larger of the median of this
  worker's and of everyone's recent accepted norms of pushes that carry the same fragments (once ``min_history``
  such pushes were accepted, and never against a median of 0). A median follows a schedule (warm-up, decay) and
  ignores one odd push; a multiple of it still lets a push several times larger than usual through (a longer
  round, a loss spike), so that only an outlier by an order of magnitude is refused. With ``stagger=F`` a push
  carries one of ``F`` parts (its norm ~1/sqrt(F) of the whole model's, and parts differ in size) and a goodbye
  the whole model: each kind has its own history, as one mixed median would refuse honest pushes or pass bad ones.

A worker can also discard its own round (its local steps went non-finite): it pushes with no steps, which the
outer side counts as a rejection of that worker. ``max_rejections`` rejections in a row exclude the worker.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_int, check_number, require

#: Reasons a push is rejected (logged, and counted in ``async/worker{i}/rejected``).
DISCARDED_BY_WORKER = "discarded by the worker (its local steps went non-finite)"


class PushCheck(KnownArguments):
    """The checks on arriving pushes (the strategies' ``check_pushes=PushCheck(...)``; ``True`` is ``PushCheck()``,
    ``False`` checks nothing), and the recent accepted norms they compare with (each run's outer state holds a
    :meth:`fresh` copy).

    Args:
        max_norm_ratio: a push whose norm exceeds this multiple of the reference median is rejected.
        max_rejections: rejections in a row after which a worker is excluded.
        window: accepted norms kept, per worker and overall, for each part (``-1``: the whole model).
        min_history: accepted pushes (overall, of the same part) before the norm rule applies.
    """

    MAX_NORM_RATIO = 10.0
    MAX_REJECTIONS = 3

    def __init__(self, max_norm_ratio: float = MAX_NORM_RATIO, max_rejections: int = MAX_REJECTIONS,
                 window: int = 32, min_history: int = 4) -> None:
        check_number("max_norm_ratio", max_norm_ratio, low=1, low_open=True,
                     hint="A push is refused when its norm exceeds this multiple of the recent median.")
        check_int("max_rejections", max_rejections, minimum=1,
                  hint="A worker whose pushes are rejected this many times in a row stops.")
        check_int("window", window, minimum=1)
        check_int("min_history", min_history, minimum=1)
        self.max_norm_ratio, self.max_rejections = max_norm_ratio, max_rejections
        self.window, self.min_history = window, min_history
        self._all: dict[int, deque[float]] = {}  # by part
        self._own: dict[tuple[int, int], deque[float]] = {}  # by (worker, part)

    def numbers(self) -> dict[str, float]:
        """Every option in force (the run config)."""
        return {"max_norm_ratio": self.max_norm_ratio, "max_rejections": self.max_rejections, "window": self.window,
                "min_history": self.min_history}

    def fresh(self) -> PushCheck:
        """The same options, no history (what one run's outer state holds)."""
        return PushCheck(**self.numbers())  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"PushCheck({', '.join(f'{k}={v!r}' for k, v in self.numbers().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PushCheck) and self.numbers() == other.numbers()

    __hash__ = None  # type: ignore[assignment]

    def limit(self, worker: int, part: int = -1) -> float:
        """The largest norm ``worker``'s next push of ``part`` (``-1``: the whole model) may have (``inf`` until
        the norm rule applies). A whole-model push with too little history of its own (a staggered run's goodbye)
        is judged against the parts' medians added in squares, ``||theta||^2 = sum_p ||theta_p||^2``."""
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
        """Record an applied push's norm (of ``part``; ``-1``: the whole model)."""
        self._all.setdefault(part, deque(maxlen=self.window)).append(norm)
        self._own.setdefault((worker, part), deque(maxlen=self.window)).append(norm)

    def inspect(self, worker: int, fragments: Iterable[Tensor], ranges: Sequence[tuple[int, int]],
                stage: Tensor | None, part: int = -1) -> tuple[str | None, list[Tensor], float]:
        """Read every arriving fragment (all of them, so that a stream is always consumed), check its form and
        norm (against pushes of the same ``part``), and keep it: a view of the fragment itself (``stage=None``: the
        caller's tensors stay valid), or a copy in ``stage``'s slice (a stream reuses its buffers). Returns
        ``(reason, kept, norm)``; ``reason`` is ``None`` for a push that may be applied."""
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
    """What is wrong with a push's floating-point buffer values (``None``: nothing)."""
    if buffers is None:
        return None
    if buffers.dtype != torch.float32 or buffers.numel() != n_buffers:
        return f"buffers are {buffers.dtype}[{buffers.numel()}], expected torch.float32[{n_buffers}]"
    if not bool(torch.isfinite(buffers).all()):
        return "non-finite buffer values"
    return None


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
