"""A metric logged with ``sync_dist=True`` stays each HDET group's own while the vote reads it (``monitor``).

Lightning reduces ``self.log(name, value, sync_dist=True)`` through the strategy's ``reduce(value, group=None)``,
over every rank. Under ``HDETCallback(monitor=name)`` that would hand every group the whole job's mean, so every
vote would see a tie (and group 0 would win it). :class:`GroupMetricSync`, mixed into the Trainer's HDET strategies
before their Lightning base, reduces such a metric over this rank's group instead while ``group_metrics`` is on:
the callback turns it on for each validation under ``monitor``
(:meth:`~lightning_hdet.hdet.execution.executor.HDETParts. sync_metrics_in_groups`). A metric logged with an explicit
``sync_dist_group`` is left alone, and Lightning's own decisions (``reduce_boolean_decision``: ``ModelCheckpoint``,
``EarlyStopping``, stopping) stay over every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch.distributed import ReduceOp


class GroupMetricSync:
    """``reduce`` over this rank's HDET group while :attr:`group_metrics` is on (see the module docstring).

    A host provides ``_guard_process_group`` (the process group of this rank's group), ``root_device``,
    ``world_size``, ``communicator`` (:class:`~lightning_hdet.hdet.execution.comm.Communicator`) and a Lightning
    ``reduce``.
    """

    group_metrics: bool = False  # on only while a validation the vote reads runs

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

