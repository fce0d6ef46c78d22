"""What HDET runs when nothing is given: the measured best, and the paper's set-up one name away (pure).

One definition, so the evidence can move it (docs/benchmarks.md, benchmark 2: "search, then train in one run" was
below the best equal-compute baseline on the char LM from every start): ``Trainer(strategy="hdet")`` searches over
a wide spread of learning rates with each group its own DDP job (``gradient_sync="group"``) for the first quarter
of the run (``vote="pbt"``, :class:`~lightning_hdet.hdet.options.Search`), then trains every group around the LR it
found with gradients averaged over all ranks. ``strategy="hdet_published"`` is the paper's set-up (ALGORITHMS.md
§1): the ±11 % fan-out, one shared gradient, the softmax controller, no end to the search.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# HDETCallback's defaults.
DEFAULT_VOTE = "pbt"
DEFAULT_SEARCH = True  # Search(): ends at SEARCH_FRACTION of the run
# Where Search() may end, as a fraction of the run. A quarter, not the half of 1.0: in benchmark 2's insurance round
# (docs/research/2026-12-hdet-search.md, "The search ends at a quarter") it was at or below the half in 44 of 54 runs
# (three workloads, three starts, six seeds; median 0.99x); the search is the premium a run pays when its LR was right.
SEARCH_FRACTION = 0.25

# HDETStrategy's defaults: a geometric grid of multipliers whose largest is this many times the smallest (with four
# groups a factor 3 between neighbours, the grid benchmark 2 measured), centred on the optimizer's LR.
DEFAULT_LR_SPAN = 27.0
DEFAULT_GRADIENT_SYNC = "group"
PUBLISHED_SPREAD = 1 / 9


@dataclass(frozen=True)
class Preset:
    """A strategy name's defaults: the multipliers (a geometric ``span`` or the published linear ``spread``), the
    gradient sync, and the HDETCallback it installs when none is passed (its keyword arguments)."""

    name: str
    gradient_sync: str
    span: Optional[float] = None
    spread: Optional[float] = None
    callback: dict[str, Any] = field(default_factory=dict)


RECOMMENDED = Preset("recommended", DEFAULT_GRADIENT_SYNC, span=DEFAULT_LR_SPAN)
PUBLISHED = Preset("published", "global", spread=PUBLISHED_SPREAD, callback={"vote": "softmax", "search": False})
PRESETS = {p.name: p for p in (RECOMMENDED, PUBLISHED)}
# The preset of every HDET entry point when none is named: the Trainer's "hdet" and "hdet_fsdp" and Fabric's "hdet"
# (whose HDETLoop takes the preset's vote and search too), so the three never differ silently.
DEFAULT_PRESET = RECOMMENDED.name


def span_grid(num_groups: int, span: float) -> list[float]:
    """``num_groups`` multipliers in geometric progression from ``span ** -0.5`` to ``span ** 0.5`` (mean of logs 0)."""
    if num_groups == 1:
        return [1.0]
    return [span ** (g / (num_groups - 1) - 0.5) for g in range(num_groups)]
