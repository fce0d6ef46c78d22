"""Merges and the restore point: one :class:`Merger` per rank, owned by the strategy, built on injected collectives.

A :class:`Merger` is given *what* a merge carries (a :class:`MergeSite`: the full replica of ``"hdet"``, the local
shards of ``"hdet_fsdp"``, one row of a tensor in :class:`~lightning_hdet.testing.FakeWorld`) and *how* the ranks
sum (a :class:`~lightning_hdet.hdet.execution.comm.GroupComm`: process groups in a run, threads in memory in a test).
Merging in 25 MiB buckets, the finite check before the restore point is overwritten, the roll-back, the optimizer
restart and the validation swap are written once, here, and run unchanged by the strategies and by the in-memory fake.
It owns one piece of state: the restore point (the last good merge target of this rank's tensors, a flat host copy,
pinned on CUDA), and the initial model where the plateau rule keeps it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch import Tensor
from typing_extensions import override

from lightning_hdet._compat import unwrap_optimizer
from lightning_hdet._sharding import reshard
from lightning_hdet._tensors import (
    all_finite,
    flat_dtype,
    host_buffer,
    host_copy,
    is_schedule_free,
    local,
    numel,
    read_into,
    reduced_buckets,
    sync_device,
    write_from,
)
from lightning_hdet.hdet.execution.comm import GroupComm
from lightning_hdet.hdet.execution.validation import MergedValidation

log = logging.getLogger(__name__)


class MergePart(NamedTuple):
    """Tensors a merge averages with one collective: each rank contributes ``coefficient * scale * t`` and
    ``group`` (``None``: all ranks) sums the contributions."""

    tensors: list[Tensor]
    scale: float
    group: Any


def iterate_states(optimizers: Sequence[Any], params: Sequence[Tensor]) -> list[Tensor]:
    """The schedule-free base iterate ``z`` of every parameter a schedule-free optimizer owns, in ``params`` order
    (this rank's shard of it). A parameter not stepped yet gets a scratch copy of itself (what its ``z`` starts
    from), so every rank of a merge carries the same tensors.

    Why: schedule-free optimizers (``schedulefree``) hold the parameters at ``y = (1 - beta) z + beta x`` and keep
    ``z`` in their state; the average ``x`` they evaluate is implied. Blending ``y`` alone leaves each group its
    own ``z``: after ``eval()``, ``x = (y - (1 - beta) z) / beta`` is a point no group reached (a PBT copy would
    put a loser's ``z`` under the winner's weights). Blending ``z`` with the same coefficients keeps both linear.
    """
    owners = {p: opt for opt in map(unwrap_optimizer, optimizers) if is_schedule_free(opt)
              for group in opt.param_groups for p in group["params"]}
    iterates = []
    for p in params:
        if p in owners:
            z = owners[p].state.get(p, {}).get("z")
            iterates.append(local(z) if z is not None else local(p.detach()).clone())
    return iterates


class MergeSite(Protocol):
    """What one rank's merges carry, and what a merge does to the rest of its training state."""

    def merge_parts(self) -> list[MergePart]:
        """The tensors a merge averages, in the order of the restore point."""

    def iterate_part(self) -> MergePart:
        """Schedule-free optimizers' base iterates (:func:`iterate_states`), reduced as the parameters are: merged
        after the restore point's parts, not kept in it (a roll-back restarts the optimizers)."""

    def clear_optimizer_state(self) -> None:
        """Restart the optimizers (moments gathered on another model would mislead them)."""

    def reshard(self) -> None:
        """Make the tensors of :meth:`merge_parts` what the next forward reads (FSDP2: free gathered parameters)."""


class Merger:
    """Merge, keep the last good target, roll back, swap the merged model in for validation (see the module
    docstring). Call every method on every rank with the same arguments: they run collectives through ``groups``."""

    def __init__(self, site: MergeSite, groups: GroupComm) -> None:
        self.site = site
        self.groups = groups
        self._restore_point: Optional[Tensor] = None
        self._initial_point: Optional[Tensor] = None  # the model at the start of a fresh fit, if asked to keep it
        self._validation = MergedValidation()

    @property
    def restore_point(self) -> Optional[Tensor]:
        """The flat host copy a roll-back returns to (``None`` before the first :meth:`ensure_restore_point`)."""
        return self._restore_point

    @property
    def initial_point(self) -> Optional[Tensor]:
        """The initial model, when :meth:`ensure_restore_point` was asked to keep it."""
        return self._initial_point

    def load_restore_point(self, flat: Optional[Tensor]) -> None:
        """Take ``flat`` (a checkpoint's ``last_good``) as the restore point; ``None`` forgets it, so the next
        :meth:`ensure_restore_point` takes the current state."""
        self._restore_point = None if flat is None else host_copy(flat)

    def _restorable_tensors(self) -> list[Tensor]:
        return [t for part in self.site.merge_parts() for t in part.tensors]

    def merge(
        self, coefficients: Sequence[float], strengths: Sequence[float], restart: Sequence[bool], keep: bool = True
    ) -> None:
        """Blend the groups' parameters and floating-point buffers, one bucket of at most 25 MiB at a time.

        ``target = sum_g coefficients[g] * theta_g`` (all-reduces bucket by bucket, so a merge needs one bucket of
        extra device memory); each group moves ``theta_g <- (1 - strengths[g]) * theta_g + strengths[g] * target``.
        A group whose coefficient is 0 contributes zeros, so non-finite values of a diverged group never reach the
        target. When ``keep`` (the safety net judged the vote good) and every contributing group is finite, the
        target becomes the restore point, written into its host copy bucket by bucket; the groups flagged in
        ``restart`` clear their optimizer state.
        """
        index, device = self.groups.group_index, self.groups.root_device
        parts, iterates = self.site.merge_parts(), self.site.iterate_part()
        tensors = [t for part in parts for t in part.tensors]
        coefficient = float(coefficients[index])
        keep = keep and self._contributions_finite(tensors + iterates.tensors, coefficient, coefficients)
        if keep:
            self._restore_point = self._restore_buffer(tensors)
        strength, offset = float(strengths[index]), 0
        for part in [*parts, iterates]:
            reduce = functools.partial(self.groups.all_reduce, group=part.group)
            for bucket, flat in reduced_buckets(part.tensors, coefficient * part.scale, reduce):
                bucket.scatter(flat, strength)
                if keep and part is not iterates:
                    start = offset + bucket.offset
                    self._restore_point[start : start + bucket.numel].copy_(flat, non_blocking=True)
                del flat  # one bucket alive at a time
            offset += numel(part.tensors)
        sync_device(device)  # the host copy is read later: the non-blocking copies must have landed
        if restart[index]:
            self.site.clear_optimizer_state()
        log.debug("merge: coefficients %s, strengths %s", list(coefficients), list(strengths))

    def _contributions_finite(self, tensors: list[Tensor], coefficient: float, coefficients: Sequence[float]) -> bool:
        """Whether every group with a non-zero coefficient holds finite values, i.e. the target will be finite:
        known before any bucket is written (one small all-reduce and one host read per merge). A group is finite
        when all its ranks are (each holds a replica or a shard)."""
        finite = all_finite(tensors) if coefficient != 0.0 else torch.ones((), dtype=torch.bool)
        row = self.groups.gather_group_values(finite.double().reshape(1))[:, 0]
        return all(float(n) == self.groups.layout.group_size for n, c in zip(row, coefficients) if c != 0.0)

    def _restore_buffer(self, tensors: list[Tensor]) -> Tensor:
        """The host buffer of the restore point (reused; pinned on CUDA)."""
        size, dtype = numel(tensors), flat_dtype(tensors)
        held = self._restore_point
        if held is not None and held.numel() == size and held.dtype == dtype:
            return held
        return host_buffer(size, self.groups.root_device, dtype)

    def ensure_restore_point(self, keep_initial: bool = False) -> None:
        """Make the current state the restore point unless one is held (from a merge or a checkpoint); with
        ``keep_initial``, also keep that state apart as the initial model (a second host copy, fresh runs only: a
        resumed run's restore point is its last good merge, and no initial model is held)."""
        if self._restore_point is None:
            tensors, device = self._restorable_tensors(), self.groups.root_device
            self._restore_point = read_into(tensors, self._restore_buffer(tensors), device)
            if keep_initial:  # pinned like the restore point on CUDA
                held = self._restore_point
                self._initial_point = host_buffer(held.numel(), device, held.dtype).copy_(held)

    def restore(self, initial: Sequence[bool] = ()) -> None:
        """Roll back to the restore point, or, for the groups flagged in ``initial``, to the initial model where one
        is held (:meth:`ensure_restore_point`); every group restarts its optimizer state."""
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        held = self._initial_point
        fresh = held is not None and bool(initial) and bool(initial[self.groups.group_index])
        write_from(self._restorable_tensors(), held if fresh else self._restore_point, self.groups.root_device)
        self.site.clear_optimizer_state()
        log.debug("roll-back to the %s", "initial model" if fresh else "restore point")

    def restart_groups(self, initial: Sequence[bool]) -> bool:
        """The groups flagged in ``initial`` take the initial model and restart their optimizer state; the others
        keep theirs (no collective). ``False``, and nothing changes, where no initial model is held."""
        held = self._initial_point
        if held is None:
            return False
        if initial[self.groups.group_index]:
            write_from(self._restorable_tensors(), held, self.groups.root_device)
            self.site.clear_optimizer_state()
        return True

    def restart_from_initial(self) -> bool:
        """Every group takes the initial model, which becomes the restore point too (a later roll-back must not
        return to the weights it replaced), and restarts its optimizer state; ``False``, and nothing changes, where
        no initial model is held (:meth:`ensure_restore_point`)."""
        if self._initial_point is None:
            return False
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        self._restore_point.copy_(self._initial_point)
        self.restore()
        return True

    def validate_merged(self, on: bool) -> None:
        """``on``: every rank holds the checkpoint's merged model (its own state kept on the host), for validation;
        off: each group's own state back (:mod:`~lightning_hdet.hdet.execution.validation`). Idempotent; ``on`` is a
        collective."""
        if on:
            self._validation.swap_in(self)
        else:
            self._validation.swap_out(self)


class MergeOps:
    """The Lightning hooks that test and predict with the merged model, through the strategy's merger."""

    hdet: Any  # the strategy's HDETParts (its ``merger`` swaps the merged model in and out)

    @override
    def on_test_start(self) -> None:
        """Test (and predict with) the model a checkpoint holds, as validation does: e.g. after
        ``trainer.test(ckpt_path="best")`` each group holds its own state from the checkpoint's group files."""
        super().on_test_start()  # type: ignore[misc]
        self.hdet.merger.validate_merged(True)

    @override
    def on_test_end(self) -> None:
        self.hdet.merger.validate_merged(False)
        super().on_test_end()  # type: ignore[misc]

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self.hdet.merger.validate_merged(True)

    @override
    def on_predict_end(self) -> None:
        self.hdet.merger.validate_merged(False)
        super().on_predict_end()  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """An exception inside validation gives each group its own state back (no collective): what the model in
        memory holds after a failed ``fit``, and what a retry or a later ``trainer.save_checkpoint`` starts from."""
        self.hdet.merger.validate_merged(False)
        super().on_exception(exception)  # type: ignore[misc]


class StrategySite:
    """The part of a :class:`MergeSite` every strategy shares: its optimizers restart, its module reshards."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def clear_optimizer_state(self) -> None:
        for optimizer in self.strategy.optimizers:
            optimizer.state.clear()

    def reshard(self) -> None:
        reshard(self.strategy.lightning_module)
