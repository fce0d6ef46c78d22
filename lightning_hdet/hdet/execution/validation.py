"""Validation sees the model the checkpoint holds: the merged model, swapped in on every rank for the loop.

Under HDET each group trains its own parameters between votes, while a checkpoint's ``state_dict`` is the merged
model (the mean of the groups whose parameters are finite: ``lightning_module_state_dict`` of both strategies).
A metric logged in ``validation_step`` would otherwise describe each rank's own group, and ``ModelCheckpoint(
monitor=...)``, ``EarlyStopping`` and the progress bar would keep or stop on a model that is not in the file.

:class:`MergedValidation` swaps the merged model in before the first validation batch and each group's own state
back after the last one, on both strategies: what a merge carries
(:meth:`~lightning_hdet.hdet.execution.merge.MergeSite. merge_parts`: parameters or their local shards, the float
buffers, and the schedule-free base iterate, so an ``optimizer.eval()`` of a schedule-free optimizer evaluates the
merged average too) is copied to one host buffer (pinned on CUDA, reused) and merged with the checkpoint's coefficients
through the strategy's own bucketed :meth:`~lightning_hdet.hdet.execution.merge.Merger.merge` (``keep=False``: the
restore point and the optimizer states are left alone). Cost per validation: one device-to-host and one host-to-device
copy of this rank's part of the model, and the merge's all-reduces.

Not under ``HDETCallback(monitor=...)``: that vote compares each group's own value of a validation metric, so
validation runs each group's own model; a warning at the start of fit names any callback that keeps or stops on
that metric (it would act on a group's value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from torch import Tensor

from lightning_hdet._tensors import all_finite, flat_dtype, host_buffer, numel, read_into, write_from


def unmerged_validation_warning(monitor: str, readers: Sequence[str]) -> str:
    """What ``readers`` (callbacks that keep or stop on ``monitor``, e.g. ``"ModelCheckpoint(monitor='val_loss')"``)
    see when the vote reads each group's own validation metric; ``""`` when there are none (nothing then acts on a
    group's value: the votes read each group's own, as they should)."""
    if not readers:
        return ""
    return (
        f"HDETCallback(monitor={monitor!r}) votes on each group's own {monitor!r}, so validation runs each group's own "
        f"model: {' and '.join(readers)} see{'s' if len(readers) == 1 else ''} a group's value, not that of the "
        "merged model a checkpoint holds (each group's value is logged as hdet/group{g}/loss at the votes). To keep "
        "checkpoints or stop by the saved model's own value, vote on the training loss (HDETCallback(monitor=None)); "
        "to keep the vote, let them monitor another metric or none."
    )




def healthy_mean(groups: Any, tensors: list[Tensor]) -> list[float]:
    """The checkpoint's merge coefficients: ``1 / k`` for each of the ``k`` groups whose ``tensors`` are finite on
    every rank, 0 for the others (every group equally when none is finite). One small all-reduce through ``groups``
    (a :class:`~lightning_hdet.hdet.execution.comm.GroupComm`)."""
    finite = groups.gather_group_values(all_finite(tensors).double().reshape(1))[:, 0]
    healthy = [float(n) == groups.layout.group_size for n in finite.tolist()]
    if not any(healthy):
        healthy = [True] * len(healthy)
    return [1.0 / sum(healthy) if h else 0.0 for h in healthy]


class MergedValidation:
    """Swap the merged model in (:meth:`swap_in`) and this rank's own state back (:meth:`swap_out`).

    Owned by a :class:`~lightning_hdet.hdet.execution.merge.Merger` (one per rank), which it is given: its ``site`` says
    what to swap, its ``groups`` how the ranks sum. Call both on every rank (collectives); each is idempotent, so an
    exception between them can always swap back.
    """

    def __init__(self) -> None:
        self._tensors: Optional[list[Tensor]] = None  # what swap_in replaced, in the order of the host copy
        self._buffer: Optional[Tensor] = None  # this rank's own state while swapped in (kept for reuse)

    @property
    def active(self) -> bool:
        """Whether the merged model is swapped in."""
        return self._tensors is not None

    def swap_in(self, merger: Any) -> None:
        """Keep this rank's own state on the host, then hold the checkpoint's merged model on every rank."""
        groups, device = merger.groups.num_groups, merger.groups.root_device
        if self.active or groups == 1:
            return
        merger.site.reshard()
        parts = [*merger.site.merge_parts(), merger.site.iterate_part()]
        tensors = [t for part in parts for t in part.tensors]
        size, dtype = numel(tensors), flat_dtype(tensors)
        if self._buffer is None or self._buffer.numel() != size or self._buffer.dtype != dtype:
            self._buffer = host_buffer(size, device, dtype)
        read_into(tensors, self._buffer, device)
        self._tensors = tensors
        model = [t for part in parts[:-1] for t in part.tensors]  # the checkpoint judges health by the model
        merger.merge(healthy_mean(merger.groups, model), [1.0] * groups, [False] * groups, keep=False)

    def swap_out(self, merger: Any) -> None:
        """Give this rank its own state back (exactly the values :meth:`swap_in` kept)."""
        if not self.active:
            return
        merger.site.reshard()  # the validation's forwards may have left merged parameters gathered
        write_from(self._tensors, self._buffer, merger.groups.root_device)
        self._tensors = None
