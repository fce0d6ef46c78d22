"""``HDETCallback(monitor="auto")``, the default: what the votes read, decided when training starts (Lightning glue).

A run that reads its training data more than once makes the training loss a measure of memorising as much as of
learning: a higher LR memorises faster, so a vote on the training loss keeps moving the LRs up while the held-out
loss rises (the research log, 2026-12-06: a 1,024-row table over 37 epochs ended at 2.1x the held-out loss of plain
DDP from the right LR, every vote won by the highest LR). There the votes read each group's own ``val_loss`` from the
module's validation instead (:mod:`~lightning_hdet.hdet.lightning.monitor`), which the same runs ended 1.00-1.06x DDP
on. A run that sees each item once (or fewer) votes on the training loss, which is then a held-out loss too, and needs
no validation.

The decision is said once on rank 0; a run whose data repeat but that has no validation, or whose validation logs no
``val_loss``, votes on the training loss with a warning naming the fix.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hdet.hdet.execution.validation import unmerged_validation_warning
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.records.wandb import record_config

AUTO = "auto"
# The metric name Lightning's own docs and most modules log in `validation_step`.
AUTO_METRIC = "val_loss"


def epochs_read(run_steps: Optional[int], epoch_steps: Optional[float]) -> Optional[float]:
    """How many times a run of ``run_steps`` optimizer steps reads its training data (``None``: not known)."""
    if run_steps is None or epoch_steps is None or not math.isfinite(epoch_steps) or epoch_steps <= 0:
        return None
    return run_steps / epoch_steps


def epoch_steps(trainer: Trainer) -> Optional[float]:
    """Optimizer steps in one epoch of this rank's training data (``None``: an iterable of unknown length)."""
    batches = trainer.num_training_batches
    if not isinstance(batches, (int, float)) or not math.isfinite(batches) or batches <= 0:
        return None
    return batches / trainer.accumulate_grad_batches


def validation_period(trainer: Trainer) -> Optional[float]:
    """Optimizer steps between two validations of this fit (``None``: it never validates, or not by steps: an
    iterable of unknown length, a time interval)."""
    every = trainer.val_check_batch
    if not isinstance(every, (int, float)) or not math.isfinite(every) or every <= 0:
        return None
    per_epoch = trainer.num_training_batches
    # Lightning's own test: a `validation_step`, validation data (else it skips the loop) and limit_val_batches > 0
    if not trainer.enable_validation:
        return None
    epochs = trainer.check_val_every_n_epoch
    if epochs is not None and epochs > 1 and isinstance(per_epoch, (int, float)) and math.isfinite(per_epoch):
        every = per_epoch * epochs  # only every n-th epoch validates
    return every / trainer.accumulate_grad_batches


# A vote on `monitor` waits for the next validation: one validation every few vote intervals would leave the search
# a vote or two. Up to this many intervals between validations the votes read it.
MAX_WAIT = 2.0


def choose(epochs: Optional[float], period: Optional[float], every: int) -> tuple[Optional[str], str]:
    """What ``monitor="auto"`` votes on (``None``: the training loss) and the line that says why (``""``: nothing to
    say, a run that reads its data at most once), for a run reading its data ``epochs`` times that validates every
    ``period`` optimizer steps (``None``: never) and votes every ``every`` steps."""
    if epochs is None or epochs <= 1.0:
        return None, ""
    read = f"the run reads its training data {epochs:.3g} times"
    if period is not None and period <= MAX_WAIT * every:
        return AUTO_METRIC, (f"HDET: {read}, so the training loss rewards memorising: the votes read each group's "
                             f"own `{AUTO_METRIC}` from validation (monitor='auto'; monitor=None votes on the "
                             "training loss).")
    fix = (f"Pass validation data and log `{AUTO_METRIC}` in a `validation_step` (the votes read it)"
           if period is None else
           f"Validate at least every {int(MAX_WAIT * every)} steps (now every {period:.0f}: Trainer(val_check_interval="
           f"{every}, check_val_every_n_epoch=None)) so that the votes can read `{AUTO_METRIC}`")
    return None, (f"HDET: {read}, so the training loss the votes compare rewards memorising (a higher LR memorises "
                  f"faster) and the run may end on too high an LR. {fix}, or pass HDETCallback(monitor='your_metric').")


def missing(metrics: dict[str, Any]) -> str:
    """The warning when the validation a repeating run's votes were to read logged no ``val_loss``
    (``metrics``: what it logged)."""
    names = sorted(k for k in metrics if not k.startswith("hdet/"))
    return (f"HDET: monitor='auto' expected `{AUTO_METRIC}` from validation (the run repeats its training data), but "
            f"validation logged {names}: the votes read the training loss, which rewards memorising. Log "
            f"`{AUTO_METRIC}`, or pass HDETCallback(monitor='your_metric').")


def decide(trainer: Trainer, run_steps: Optional[int], every: int) -> tuple[Optional[str], str]:
    """:func:`choose` for this fit, voting every ``every`` steps (the validation is looked at only where it matters)."""
    epochs = epochs_read(run_steps, epoch_steps(trainer))
    if epochs is None or epochs <= 1.0:
        return None, ""
    return choose(epochs, validation_period(trainer), every)


def recorded(settings: HDETConfig, auto: bool) -> dict[str, Any]:
    """The callback's settings as the run config records them: ``monitor="auto"`` until train start decides, then
    ``"auto: val_loss"`` (what runs)."""
    config = settings.as_dict()
    if auto:
        config["monitor"] = f"auto: {settings.monitor}" if settings.monitor else AUTO
    return config


def announce(trainer: Optional[Trainer], hdet: Any, name: Optional[str], line: str, config: dict[str, Any]) -> None:
    """Say what ``"auto"`` decided (``line``), once on rank 0: with ``name`` as information, the run config updated
    to it and the warning of what validation then shows; without one, as a warning (there is a fix to make)."""
    if name is None:
        if line:
            rank_zero_warn(line)
        return
    record_config(trainer, "hdet", {**hdet.config, "callback": config})
    rank_zero_info(line)
    warn_readers(trainer, hdet.num_groups, name)


def warn_readers(trainer: Optional[Trainer], num_groups: int, name: str) -> None:
    """Warn (rank 0) when callbacks keep or stop on ``name`` (``ModelCheckpoint(monitor=name)``,
    ``EarlyStopping(monitor=name)``, any callback whose ``monitor`` is ``name``), which validation measures on each
    group's own model while the votes read it; say nothing when none does."""
    callbacks = trainer.callbacks if trainer is not None and num_groups > 1 else []
    readers = [f"{type(cb).__name__}(monitor={name!r})" for cb in callbacks if getattr(cb, "monitor", None) == name]
    warning = unmerged_validation_warning(name, readers)
    if warning:
        rank_zero_warn(warning)
