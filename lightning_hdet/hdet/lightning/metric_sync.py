"""A metric logged with ``sync_dist=True`` stays each HDET group's own while the vote reads it (``monitor``).

Lightning reduces ``self.log(name, value, sync_dist=True)`` through the strategy's ``reduce(value, group=None)``,
over every rank. Under ``HDETCallback(monitor=name)`` that would hand every group the whole job's mean, so every
vote would see a tie (and group 0 would win it). :class:`GroupMetricSync`, mixed into the Trainer's HDET strategies
before their Lightning base, reduces such a metric over this rank's group instead while ``group_metrics`` is on:
the callback turns it on for each validation under ``monitor``
(:meth:`~lightning_hdet.hdet.execution.executor.HDETParts. sync_metrics_in_groups`). A metric logged with an explicit
``sync_dist_group`` is left alone, and Lightning's own decisions (``reduce_boolean_decision``: ``ModelCheckpoint``,
``EarlyStopping``, stopping) stay over every rank.

The data a vote compares must be the same for every group, too. Lightning's distributed sampler splits a
validation set over every rank, so each group would be measured on its own share of it and the vote would compare
different data (a difference of the size of the leads it decides on). While ``group_validation`` is on (the
callback's ``monitor`` may read a validation metric), the validation of a fit is split over the ranks of each group
only: every group validates the same data, each rank ``1 / group size`` (``num_groups / world size``) of the
validation set instead of ``1 / world size`` of it. Training data stay split over every rank.

A torchmetrics ``Metric`` syncs itself, past ``reduce``, over its own ``process_group``: one left at the default
(``None``: every rank) is given this rank's group while ``group_metrics`` is on, and its default back after, so a
metric object logged for the vote is each group's own as well. One given a ``process_group`` is left alone.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.distributed import ReduceOp

from lightning_hdet._metrics import torchmetrics_in

# The stages in which a fit builds its validation data loader (the sanity check's is the one the fit keeps).
_VALIDATION_STAGES = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING)


class GroupMetricSync:
    """``reduce`` over this rank's HDET group while :attr:`group_metrics` is on (see the module docstring).

    A host provides ``_guard_process_group`` (the process group of this rank's group), ``root_device``,
    ``world_size``, ``global_rank``, ``layout`` (:class:`~lightning_hdet.hdet.layout.GroupLayout`), ``communicator``
    (:class:`~lightning_hdet.hdet.execution.comm.Communicator`), Lightning's ``lightning_module`` and ``reduce``.
    """

    _group_metrics: bool = False  # on only while a validation the vote reads runs
    _grouped: tuple[Any, ...] = ()  # the torchmetrics objects given this rank's group, to hand their default back
    group_validation: bool = False  # a fit's validation split over each group's ranks (the callback's monitor)

    @property
    def group_metrics(self) -> bool:
        """Whether metrics are reduced over this rank's group (``sync_dist=True`` and torchmetrics objects)."""
        return self._group_metrics

    @group_metrics.setter
    def group_metrics(self, on: bool) -> None:
        for metric in self._grouped:
            metric.process_group = None
        self._grouped = ()
        if on:  # the metrics that sync over every rank (no process group of their own): over this rank's group
            self._grouped = tuple(m for m in torchmetrics_in(self.lightning_module)  # type: ignore[attr-defined]
                                  if hasattr(m, "process_group") and m.process_group is None)
            group = self._guard_process_group  # type: ignore[attr-defined]
            for metric in self._grouped:
                metric.process_group = group
        self._group_metrics = on

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank its own share of the training data; a fit's validation under ``group_validation`` split over
        this rank's group only, so that every group validates the same data (the module docstring)."""
        rank, layout = self.global_rank, self.layout  # type: ignore[attr-defined]
        if self.group_validation and _fit_validation(self.lightning_module):  # type: ignore[attr-defined]
            return {"num_replicas": layout.group_size, "rank": rank - layout.ranks(layout.group_of(rank))[0]}
        return {"num_replicas": layout.world_size, "rank": rank}

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Lightning's ``reduce``; with ``group=None`` and :attr:`group_metrics` on, over this rank's group only."""
        if group is None and self.group_metrics:
            group = self._guard_process_group  # (the ranks of this rank's group, on both strategies)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Over every rank, whatever :attr:`group_metrics` says: a stop or save decision is the whole job's."""
        count = torch.tensor(int(decision), device=self.root_device)  # type: ignore[attr-defined]
        self.communicator.all_reduce(count)  # type: ignore[attr-defined]
        return bool(count == self.world_size) if all else bool(count)  # type: ignore[attr-defined]


def _fit_validation(module: Any) -> bool:
    """Whether the trainer of ``module`` is building a fit's validation data (not training data, not a later
    ``validate``/``test``/``predict``, whose model is the one merged model)."""
    trainer = getattr(module, "_trainer", None) if module is not None else None
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING and trainer.state.stage in _VALIDATION_STAGES
