"""What :class:`~lightning_hdet.hdet.callback.HDETCallback` needs from a strategy: the HDET executor interface.

The callback (through its :class:`~lightning_hdet.hdet.controller.HDETController`) *decides*; a strategy that
implements :class:`HDETExecutor` *executes*. The callback talks to the strategy through these members only, so
another strategy (e.g. an FSDP2 one) plugs in by implementing them. Each piece of state has one owner:

* the strategy owns the process groups, the multiplier tables (the LR's and the other explored hyperparameters'),
  the skipped-step counter, the finite-gradient guard, the restore point (last good merged model, on the host)
  and the groups' parameters and optimizer states;
* the callback owns the loss accumulators, the vote's timing and logs; its controller owns the vote rule's state,
  the permutation generator and the vote counters.

Every method is called on every rank with identical arguments, in the same order (they may run collectives).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_hdet.hdet.hyperparams import Explored
from lightning_hdet.hdet.layout import GroupLayout


@runtime_checkable
class HDETExecutor(Protocol):
    """The strategy side of HDET (implemented by :class:`~lightning_hdet.hdet.strategy.HDETStrategy`)."""

    @property
    def layout(self) -> GroupLayout:
        """Which ranks form which group."""

    @property
    def num_groups(self) -> int: ...

    @property
    def group_index(self) -> int:
        """The group of this rank."""

    @property
    def gradient_sync(self) -> str:
        """``"global"`` (gradients averaged over all ranks) or ``"group"`` (inside each group)."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def config(self) -> dict[str, Any]:
        """The strategy's settings, recorded in the run config under ``hdet/...``."""

    @property
    def lr_multipliers(self) -> Tensor:
        """A copy of the multiplier table, ``(num_groups, num_param_groups)``, float64 on the host."""

    def set_gradient_sync(self, gradient_sync: str) -> None:
        """Average gradients over all ranks (``"global"``) or inside each group (``"group"``) from the next step on
        (the only writer after construction; a wrapped model is wrapped again, a collective)."""

    def set_lr_multipliers(self, multipliers: Any) -> None:
        """Replace the multiplier table (the only writer; applied around every later optimizer step)."""

    @property
    def explored(self) -> Explored:
        """The other explored hyperparameters' tables (copies), what the optimizers say, and whether the LR is
        explored (:mod:`~lightning_hdet.hdet.hyperparams`; empty tables: the LR alone)."""

    def set_explored(self, tables: Any) -> None:
        """Replace the explored hyperparameters' tables (the only writer; applied around every later step)."""

    def schedule_lrs(self) -> Tensor:
        """What the optimizers and schedulers say, per flattened param group (no multiplier)."""

    def current_lrs(self) -> Tensor:
        """Real learning rates ``(num_groups, num_param_groups)``: schedule LR x multiplier."""

    def enable_guard(self) -> None:
        """Flag (and, where the optimizer can, skip on the device) the optimizer steps of a group whose loss or
        gradients are non-finite. Call before the model is wrapped: from the callback's ``setup(stage="fit")``."""

    def interval_skipped(self, reset: bool = True) -> int:
        """Optimizer steps the guard flagged on this rank since the last reset (``reset=False`` only peeks); reads a
        device counter, so call it at votes, not per step."""

    def gather_group_values(self, values: Tensor) -> Tensor:
        """Sum 1-D ``values`` over the ranks of each group: ``(num_groups, k)`` on the host, on every rank."""

    def add_init_noise(self, relative_std: float, seed: int) -> None:
        """Add ``N(0, relative_std^2 |theta|^2 / d)`` to the parameters, drawn from a generator seeded ``seed``."""

    def merge(
        self, coefficients: Sequence[float], strengths: Sequence[float], restart: Sequence[bool], keep: bool = True
    ) -> None:
        """``theta_g <- (1 - s_g) theta_g + s_g sum_h c_h theta_h``; a finite target becomes the restore point
        unless ``keep`` is False (the safety net judged the vote not good); groups flagged in ``restart`` start a
        fresh optimizer state."""

    def ensure_restore_point(self, keep_initial: bool = False) -> None:
        """Make the current model state the restore point unless one is held (from a merge or a checkpoint); with
        ``keep_initial``, keep it apart as the initial model too."""

    def restore(self, initial: Sequence[bool] = ()) -> None:
        """Roll every group back to the restore point (the groups flagged in ``initial``: to the initial model, if
        held), with a fresh optimizer state."""

    def validate_merged(self, on: bool) -> None:
        """``on``: hold the checkpoint's merged model on every rank (for validation); off: each group's own state
        back. Idempotent."""

    def save_ensemble(self) -> dict[str, Any]:
        """What a checkpoint keeps of the ensemble: multipliers, the restore point and where every group's own state
        is (each group writes its own)."""

    def load_ensemble(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`save_ensemble` (the groups' own states are read when Lightning restores the model)."""


def is_executor(strategy: Any) -> bool:
    """Whether ``strategy`` has every member of :class:`HDETExecutor` (looked up without running properties)."""
    return all(inspect.getattr_static(strategy, name, None) is not None for name in _MEMBERS)


_MEMBERS: tuple[str, ...] = tuple(
    name for name in dir(HDETExecutor) if not name.startswith("_") and name not in dir(Protocol)
)

