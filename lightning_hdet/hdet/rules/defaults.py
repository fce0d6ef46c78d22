"""What HDET runs when nothing is given: the measured best, and the paper's set-up one name away (pure).

One definition, so the evidence can move it (docs/benchmarks.md, benchmark 2: "search, then train in one run" was
below the best equal-compute baseline on the char LM from every start): ``Trainer(strategy="hdet")`` searches over
a wide spread of learning rates with each group its own DDP job (``gradient_sync="group"``) for the first quarter
of the run (``vote="pbt"``, :class:`~lightning_hdet.hdet.rules.options.Search`), then trains every group around the LR it
found with gradients averaged over all ranks. ``strategy="hdet_published"`` is the paper's set-up (ALGORITHMS.md
§1): the ±11 % fan-out, one shared gradient, the softmax controller, no end to the search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

# HDETCallback's defaults.
DEFAULT_VOTE = "pbt"
DEFAULT_SEARCH = True  # Search(): ends at SEARCH_FRACTION of the run
# Where Search() may end, as a fraction of the run. A quarter, not the half of 1.0: in benchmark 2's insurance round
# (docs/research/2026-12-hdet-search.md, "The search ends at a quarter") it was at or below the half in 44 of 54 runs
# (three workloads, three starts, six seeds; median 0.99x); the search is the premium a run pays when its LR was right.
SEARCH_FRACTION = 0.25
# Search(restart_below=...): where the search ends on an LR at most this fraction of the user's, every group restarts
# from the initial model. Measured (docs/research/2026-12-hdet-search.md, "The char LM at 1,024 steps"): the char
# LM from 10x too high at 1,024 steps ended 1.8-1.9x the good LR's loss on the weights the search's high LRs left,
# 1.11-1.15x restarted (3 seeds); at 128 steps it fired only from 10x too high, never from the good or 10x low start.
RESTART_BELOW = 1 / 3

# HDETStrategy's defaults: a geometric grid of multipliers within this span (from span ** -0.5 to span ** 0.5 of the
# optimizer's LR; benchmark 2 measured four groups a factor 3 apart), one of them the optimizer's LR (span_grid).
DEFAULT_LR_SPAN = 27.0
DEFAULT_GRADIENT_SYNC = "group"
PUBLISHED_SPREAD = 1 / 9


@dataclass(frozen=True)
class Preset:
    """A strategy name's defaults: the multipliers (a geometric ``span`` or the published linear ``spread``), the
    gradient sync, the HDETCallback it installs when none is passed (its keyword arguments), and whether an unset
    ``num_groups`` means one group per rank (the paper's members) rather than :func:`default_num_groups`."""

    name: str
    gradient_sync: str
    span: Optional[float] = None
    spread: Optional[float] = None
    callback: dict[str, Any] = field(default_factory=dict)
    group_per_rank: bool = False


RECOMMENDED = Preset("recommended", DEFAULT_GRADIENT_SYNC, span=DEFAULT_LR_SPAN)
# The paper's votes read each rank's training loss (ALGORITHMS.md), also where the data repeat: no "auto" monitor.
PUBLISHED = Preset("published", "global", spread=PUBLISHED_SPREAD,
                   callback={"vote": "softmax", "search": False, "monitor": None}, group_per_rank=True)
PRESETS = {p.name: p for p in (RECOMMENDED, PUBLISHED)}
# The preset of every HDET entry point when none is named: the Trainer's "hdet" and "hdet_fsdp" and Fabric's "hdet"
# (whose HDETLoop takes the preset's vote and search too), so the three never differ silently.
DEFAULT_PRESET = RECOMMENDED.name


def span_grid(num_groups: int, span: float) -> list[float]:
    """``num_groups`` multipliers in geometric progression, one of them exactly 1 (the user's own LR always trains),
    none outside ``[span ** -0.5, span ** 0.5]``.

    An odd number is symmetric around 1 (``span ** -0.5 .. 1 .. span ** 0.5``). An even number is the next odd grid
    without its lowest point: with two groups ``[1, span ** 0.5]`` (the user's LR and a probe above it), with four
    ``span ** (-1/4, 0, 1/4, 1/2)``. The spare group probes *up* because the safety net already searches down (a
    diverged group's LR is cut, an all-stuck ensemble rolls back onto a ladder 10 to 100 times lower) while nothing
    but the vote moves a too-low LR up, and a too-low LR fails silently: it only learns slowly."""
    if num_groups == 1:
        return [1.0]
    intervals = num_groups if num_groups % 2 == 0 else num_groups - 1  # of the symmetric grid spanning `span`
    home = user_group(num_groups)
    return [span ** ((g - home) / intervals) for g in range(num_groups)]


def incumbent_grid(num_groups: int, span: float) -> list[float]:
    """The grid of ``gradient_sync="cluster"``: the user's LR (1) on the middle groups, which train as one cluster on
    half the ranks or more, and ``max(1, G // 4)`` probes on each side, geometric up to ``span ** -0.5`` and
    ``span ** 0.5`` (four groups: ``[span ** -0.5, 1, 1, span ** 0.5]``). Fewer than four groups hold no cluster of
    the user's LR beside a probe each way: :func:`span_grid`."""
    if num_groups < 4:
        return span_grid(num_groups, span)
    probes = max(1, num_groups // 4)
    below = [span ** (-0.5 * (probes - i) / probes) for i in range(probes)]
    return below + [1.0] * (num_groups - 2 * probes) + [1.0 / m for m in reversed(below)]


def user_group(num_groups: int) -> int:
    """The group :func:`span_grid` gives multiplier 1 (the user's own learning rate)."""
    return (num_groups - 1) // 2


# The default number of groups: at most this many (the split this project started from: 64 GPUs into four groups).
# More groups each see a smaller share of the batch during the search (1/64 of it with one group per rank on 64 GPUs)
# and sit closer together on the same span. Benchmark 7 (docs/benchmarks.md; tabular and shapes, one seed): at 16
# processes one group per rank was 8-10 points worse than four groups from the good LR, level or worse from 10x low.
MAX_DEFAULT_GROUPS = 4


def default_num_groups(world_size: int) -> int:
    """The groups a job of ``world_size`` ranks gets when ``num_groups`` is not given: the largest divisor of the
    world size up to :data:`MAX_DEFAULT_GROUPS` (2 -> 2, 4 -> 4, 6 -> 3, 8 -> 4 groups of 2, 64 -> 4 of 16); where no
    divisor from 2 to 4 exists (a prime world size above 3), the smallest divisor above it: one group per rank."""
    if world_size <= MAX_DEFAULT_GROUPS:
        return world_size
    fits = [g for g in range(MAX_DEFAULT_GROUPS, 1, -1) if world_size % g == 0]
    return fits[0] if fits else min(g for g in range(MAX_DEFAULT_GROUPS + 1, world_size + 1) if world_size % g == 0)


def lone_ranks_warning(world_size: int) -> Optional[str]:
    """What to do when :func:`default_num_groups` makes every rank its own group although the job has more than
    :data:`MAX_DEFAULT_GROUPS` ranks (a prime world size: no group count from 2 up divides it); ``None`` elsewhere."""
    if world_size <= MAX_DEFAULT_GROUPS or default_num_groups(world_size) < world_size:
        return None
    # world_size + 1 is even and above 4, so its default groups hold two ranks or more; world_size - 1 only from 7 on
    # (5 - 1 = 4 ranks are four groups of one again).
    sizes = f"{world_size - 1} or {world_size + 1}" if world_size - 1 > MAX_DEFAULT_GROUPS else f"{world_size + 1}"
    return (f"No group count from 2 to {MAX_DEFAULT_GROUPS} divides the world size {world_size}, so each of its"
            f" {world_size} ranks is its own HDET group, each on 1/{world_size} of the batch during the search. Run on"
            f" {sizes} processes for groups of several ranks, or pass `num_groups={world_size}` to keep this layout"
            " without this warning.")


# HDETCallback's default vote interval, sized to the run: VOTES_IN_SEARCH votes before the search ends (at
# SEARCH_FRACTION of the run), so three times as many after it, at MIN_INTERVAL to MAX_INTERVAL steps apart.
# Two, measured on two benchmarks. Benchmark 2 (char LM, shapes CNN, tabular MLP; W = G = 4, 128 steps, from the good
# LR and 10x too high and too low, 3 seeds; HDET's loss / the untuned run's, median): the mean over the nine cells was
# 1.000 with 4 votes in the search, 0.981 with 2 and 0.981 with 1; 4 votes (a vote every 8 steps) lost the shapes CNN
# from 10x too low (1.103, against 0.917 with 2): at chance level every interval's loss is noise, the votes copied
# the groups near the good LR away, and the plateau rule then cut every LR 20-100x. Benchmark 7's vote table
# (benchmarks/hdet_votes.py, tabular MLP alone, 80 and 300 steps, 4 seeds): 1.020 with 4 votes, 1.029 with 2, 1.031
# with 1 (the seeds spread by 3-5 %); 8 was the worst cell there (1.10: a vote every 10 steps copies on noise).
VOTES_IN_SEARCH = 2
# The fewest steps a vote may average over: below it one interval's mean loss is mostly batch noise (a vote every 3
# steps of the 80-step run gave 1.02-1.03 where every 5 gave 0.99-1.01).
MIN_INTERVAL = 5
# The most: the fixed interval before votes were sized to the run (issue 39), so a run longer than
# MAX_INTERVAL * VOTES_IN_SEARCH / SEARCH_FRACTION (800) steps votes as it did.
MAX_INTERVAL = 100
# A run of unknown length (no max_steps, unbounded epochs or an iterable dataset of no length) votes this often.
UNKNOWN_LENGTH_INTERVAL = 100


def vote_interval(run_steps: Optional[int]) -> int:
    """The default ``every_n_steps`` of a run of ``run_steps`` optimizer steps (``None``: unknown)."""
    if run_steps is None:
        return UNKNOWN_LENGTH_INTERVAL
    return min(MAX_INTERVAL, max(MIN_INTERVAL, round(run_steps * SEARCH_FRACTION / VOTES_IN_SEARCH)))


def validation_aligned_interval(every: int, period: float) -> int:
    """The sized vote interval ``every`` moved to the nearest whole multiple of ``period`` (at least one), the
    optimizer steps between two validations, for votes that read a validation metric. A vote due between two
    validations waits for the next, so an interval off the validation's grid votes unevenly, and not at the interval
    the run config shows (38 steps against a validation every 30: votes at 60, 90, 120, 180, ...). The nearest
    multiple, not the one above or below, keeps the interval as close as the validation allows to the
    :data:`VOTES_IN_SEARCH` votes it was sized for: at most half a validation interval off, so where validation comes
    at least every ``every`` steps the vote that ends the search is still the second or later. A tie goes to the
    longer interval (fewer votes, each on more steps: at chance level a short interval copies on noise). A ``period``
    of a fraction of a step (accumulated gradients) has no such grid: ``every`` as it was."""
    if period <= 0 or not float(period).is_integer():
        return every
    period = int(period)
    return period * max(1, math.floor(every / period + 0.5))
