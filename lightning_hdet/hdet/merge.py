"""Merges and the restore point, shared by both HDET strategies: only which tensors a rank holds differs.

:class:`MergeOps` is the base of :class:`~lightning_hdet.hdet.ensemble.EnsembleOps` (``"hdet"``: full replicas)
and :class:`~lightning_hdet.hdet.fsdp_ensemble.ShardedEnsembleOps` (``"hdet_fsdp"``: local shards). A subclass
says what a merge carries through one hook, :meth:`MergeOps._merge_parts`; merging in 25 MiB buckets, the finite
check before the restore point is overwritten, the roll-back and the optimizer restart are written once, here.
It reads the strategy's ``layout``, ``group_index``, ``world_size``, ``root_device``, ``optimizers``,
``gather_group_values`` and ``set_lr_multipliers``, and owns one piece of state: the restore point (the last good
merge target of this rank's tensors, a flat host copy, pinned on CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_hdet._compat import unwrap_optimizer
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
from lightning_hdet.hdet.validation import MergedValidation

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


class MergeOps:
    """Merge, keep the last good target, roll back (see the module docstring)."""

    _restore_point: Optional[Tensor]
    _initial_point: Optional[Tensor] = None  # the model at the start of a fresh fit, if asked to keep it

    def _merge_parts(self) -> list[MergePart]:
        """What this rank's merges carry, in the order of the restore point (the strategy's hook)."""
        raise NotImplementedError

    def _iterate_part(self) -> MergePart:
        """Schedule-free optimizers' base iterates (:func:`iterate_states`), reduced as the parameters are (the
        strategy's hook): merged after the restore point's parts, not kept in it (a roll-back restarts the
        optimizers), so only merges build it."""
        raise NotImplementedError

    def _restorable_tensors(self) -> list[Tensor]:
        return [t for part in self._merge_parts() for t in part.tensors]

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
        parts, iterates = self._merge_parts(), self._iterate_part()
        tensors = [t for part in parts for t in part.tensors]
        coefficient = float(coefficients[self.group_index])
        keep = keep and self._contributions_finite(tensors + iterates.tensors, coefficient, coefficients)
        if keep:
            self._restore_point = self._restore_buffer(tensors)
        strength, offset = float(strengths[self.group_index]), 0
        for part in [*parts, iterates]:
            for bucket, flat in reduced_buckets(part.tensors, coefficient * part.scale, _AllReduce(part.group)):
                bucket.scatter(flat, strength)
                if keep and part is not iterates:
                    start = offset + bucket.offset
                    self._restore_point[start : start + bucket.numel].copy_(flat, non_blocking=True)
                del flat  # one bucket alive at a time
            offset += numel(part.tensors)
        sync_device(self.root_device)  # the host copy is read later: the non-blocking copies must have landed
        if restart[self.group_index]:
            self._clear_optimizer_state()
        log.debug("merge: coefficients %s, strengths %s", list(coefficients), list(strengths))

    def _contributions_finite(self, tensors: list[Tensor], coefficient: float, coefficients: Sequence[float]) -> bool:
        """Whether every group with a non-zero coefficient holds finite values, i.e. the target will be finite:
        known before any bucket is written (one small all-reduce and one host read per merge). A group is finite
        when all its ranks are (each holds a replica or a shard)."""
        finite = all_finite(tensors) if coefficient != 0.0 else torch.ones((), dtype=torch.bool)
        row = self.gather_group_values(finite.double().reshape(1))[:, 0]
        return all(float(n) == self.layout.group_size for n, c in zip(row, coefficients) if c != 0.0)

    def _restore_buffer(self, tensors: list[Tensor]) -> Tensor:
        """The host buffer of the restore point (reused; pinned on CUDA)."""
        size, dtype = numel(tensors), flat_dtype(tensors)
        held = self._restore_point
        if held is not None and held.numel() == size and held.dtype == dtype:
            return held
        return host_buffer(size, self.root_device, dtype)

    def ensure_restore_point(self, keep_initial: bool = False) -> None:
        """Make the current state the restore point unless one is held (from a merge or a checkpoint); with
        ``keep_initial``, also keep that state apart as the initial model (a second host copy, fresh runs only: a
        resumed run's restore point is its last good merge, and no initial model is held)."""
        if self._restore_point is None:
            tensors = self._restorable_tensors()
            self._restore_point = read_into(tensors, self._restore_buffer(tensors), self.root_device)
            if keep_initial:  # pinned like the restore point on CUDA
                held = self._restore_point
                self._initial_point = host_buffer(held.numel(), self.root_device, held.dtype).copy_(held)

    def restore(self, initial: Sequence[bool] = ()) -> None:
        """Roll back to the restore point, or, for the groups flagged in ``initial``, to the initial model where one
        is held (:meth:`ensure_restore_point`); every group restarts its optimizer state."""
        assert self._restore_point is not None, "ensure_restore_point() runs at the start of fit"
        held = self._initial_point
        fresh = held is not None and bool(initial) and bool(initial[self.group_index])
        write_from(self._restorable_tensors(), held if fresh else self._restore_point, self.root_device)
        self._clear_optimizer_state()
        log.debug("roll-back to the %s", "initial model" if fresh else "restore point")

    def load_ensemble(self, state: dict[str, Any]) -> None:
        """Multipliers and restore point from ``checkpoint["hdet"]`` (this rank's restore point; the groups' own
        states are read when Lightning restores the model and optimizers)."""
        self.set_lr_multipliers(state["lr_multipliers"])
        if state.get("last_good") is not None:
            self._restore_point = host_copy(state["last_good"])

    def validate_merged(self, on: bool) -> None:
        """``on``: every rank holds the checkpoint's merged model (its own state kept on the host), for validation;
        off: each group's own state back (:mod:`~lightning_hdet.hdet.validation`). Idempotent; ``on`` is a collective."""
        view = self.__dict__.setdefault("_merged_validation", MergedValidation())
        if on:
            view.swap_in(self)
        else:
            view.swap_out(self)

    @override
    def on_test_start(self) -> None:
        """Test (and predict with) the model a checkpoint holds, as validation does: e.g. after
        ``trainer.test(ckpt_path="best")`` each group holds its own state from the checkpoint's group files."""
        super().on_test_start()  # type: ignore[misc]
        self.validate_merged(True)

    @override
    def on_test_end(self) -> None:
        self.validate_merged(False)
        super().on_test_end()  # type: ignore[misc]

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self.validate_merged(True)

    @override
    def on_predict_end(self) -> None:
        self.validate_merged(False)
        super().on_predict_end()  # type: ignore[misc]

    @override
    def on_exception(self, exception: BaseException) -> None:
        """An exception inside validation gives each group its own state back (no collective): what the model in
        memory holds after a failed ``fit``, and what a retry or a later ``trainer.save_checkpoint`` starts from."""
        self.validate_merged(False)
        super().on_exception(exception)  # type: ignore[misc]

    def _clear_optimizer_state(self) -> None:
        """A rescued group restarts its optimizer state (moments from the diverged region would mislead it)."""
        for optimizer in self.optimizers:
            optimizer.state.clear()


class _AllReduce:
    """Sum a bucket over ``group`` in place (nothing to do without a process group of several ranks)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, flat: Tensor) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, group=self.group)
