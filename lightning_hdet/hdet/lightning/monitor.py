"""The vote on a logged metric (``HDETCallback(monitor=...)``): when it runs, and whether the values are each group's.

* **When.** A vote due at step ``s`` waits for the first validation that ends at or after ``s`` (Lightning validates
  after the step's ``on_train_batch_end``, where the vote falls due), so it always reads a value measured after the
  interval it closes; validating and voting every ``N`` steps puts both at the same step. A run that ends first
  votes in ``on_train_end`` on the last value (``_missing_metric`` if there never was one).
* **Each group's own.** With ``sync_dist=True`` Lightning would average the value over every rank; the strategy
  reduces it over the group instead during that validation, and syncs a torchmetrics ``Metric`` left at its default
  process group there too (:mod:`~lightning_hdet.hdet.lightning.metric_sync`). A value
  synced some other way (a ``Metric`` given its own process group, an explicit ``sync_dist_group``, the user's
  own all-reduce) is still the job's: :class:`MonitoredMetric` sees every group report the same value while their
  parameters differ (a fingerprint of each group's parameters rides along the vote's one all-reduce), warns with
  the fix and counts it (``ties``, reported in the result's summary).

Pure torch: no Lightning, no process group (the fingerprint's sum over the ranks is the vote's own all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hdet.hdet.rules.defaults import validation_aligned_interval

# Two values the same to this relative tolerance are the same number summed in another order (the all-reduce adds
# the ranks of a group in an order that may differ per column), not two groups' measurements.
_SAME = 1e-9

FINGERPRINT_WIDTH = 2


class MonitoredMetric:
    """The monitored metric of one rank: its latest value, a vote waiting for validation, the ties seen."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.value: Optional[float] = None  # this rank's latest value after a validation (not the sanity check)
        self.pending = False  # a vote fell due and waits for the next validation to end
        self.ties = 0  # votes whose groups reported one value although their parameters differ

    def read(self, metrics: dict[str, Any]) -> bool:
        """Take the value a validation just logged (``trainer.callback_metrics``), if it logged one; True when a
        waiting vote is due now (it is no longer waiting)."""
        value = metrics.get(self.name)
        if value is not None:
            self.value = float(value)
        due = self.pending and self.value is not None
        self.pending = self.pending and not due
        return due

    @staticmethod
    def fingerprint(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
        """``[sum, sum of squares]`` of this rank's part of the model, in float64 on ``device``: summed over the
        ranks of a group by the vote's all-reduce (replicas or shards alike), it tells groups' parameters apart."""
        total = torch.zeros(FINGERPRINT_WIDTH, dtype=torch.float64, device=device)
        for t in tensors:
            flat = t.detach().to(device, torch.float64)
            total[0] += flat.sum()
            total[1] += flat.square().sum()
        return total

    def check(self, step: int, losses: Sequence[float], fingerprints: Tensor) -> Optional[str]:
        """The warning when every group reports the same value while their ``fingerprints`` (one row per group)
        differ; counted in :attr:`ties`. ``None`` when the values are each group's (or the groups are one model)."""
        if len(losses) < 2 or not all(math.isfinite(v) for v in losses) or not _all_same(losses):
            return None
        if all(_all_same(column) for column in fingerprints.t().tolist()):
            return None  # the groups hold one model (e.g. right after a merge): one value is right
        self.ties += 1
        return (
            f"HDET: vote at step {step}: every group reported {self.name}={losses[0]:.6g} although the groups' "
            f"parameters differ, so the vote cannot tell them apart (group 0 wins the tie). The value is the whole "
            f"job's, not each group's: a `self.log(..., sync_dist=True)` is reduced inside each group while "
            f"HDET validates, and so is a torchmetrics Metric left at its default `process_group`, but a value "
            f"synced another way is not (a Metric given a `process_group`, `sync_dist_group=...`, an all_reduce of "
            f"your own). Sync it over this rank's group "
            f"(`trainer.strategy.group_process_group`), log it without syncing, or vote on the training loss "
            f"(monitor=None). Ties so far: {self.ties}."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"monitored": self.value, "vote_pending": self.pending, "monitor_ties": self.ties}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint of a run that voted on the training loss has none of these: nothing monitored yet
        self.value = state.get("monitored")
        self.pending = bool(state.get("vote_pending", False))
        self.ties = int(state.get("monitor_ties", 0))


def _all_same(values: Sequence[float]) -> bool:
    first = values[0]
    return all(math.isclose(v, first, rel_tol=_SAME, abs_tol=0.0) for v in values[1:])


def validation_plan(requested: Optional[int], every: int, period: Optional[float],
                    name: str) -> tuple[int, str, str]:
    """The vote interval of votes on ``name``, logged by a validation every ``period`` optimizer steps (``None``: not
    by steps), for a run voting every ``every`` steps (``requested``: the user's ``every_n_steps``, ``None``: sized
    to the run): the interval, the line saying it moved and the warning for a given interval off the validation's
    grid (``""``: none). A sized interval moves to a whole multiple of ``period``
    (:func:`~lightning_hdet.hdet.rules.defaults.validation_aligned_interval`), its first vote at the first multiple
    at or after the sized interval (the callback's: an earlier first vote is the most short-horizon-biased decision,
    the research log's "Votes aligned to validation"); a given one stays, what the user wrote is what runs."""
    aligned = every if period is None else validation_aligned_interval(every, period)
    if aligned == every:  # (no validation grid of whole steps, or already on it)
        return every, "", ""
    period = int(period)
    if requested is None:
        first = math.ceil(every / aligned) * aligned
        return aligned, (f"HDET: a vote every {aligned} steps from step {first} (sized to the run: every {every}), "
                         f"the nearest whole multiple of the validation interval ({period} steps), so that every vote "
                         f"reads a fresh `{name}` and the votes are evenly spaced."), ""
    return every, "", (f"HDET: HDETCallback(every_n_steps={every}) votes on `{name}`, which validation logs every "
                       f"{period} optimizer steps: a vote due between two validations waits for the next one, so the "
                       f"votes come unevenly and not every {every} steps. Give every_n_steps a multiple of {period} "
                       f"(e.g. {aligned}), or validate every {every} optimizer steps.")
