"""Optimizers of the demo models: AdamW, SGD and two that need no LR tuning (Prodigy, schedule-free AdamW).

Prodigy (``prodigyopt``) estimates its step size itself; its ``lr`` is a multiplier of that estimate (1.0 is
the recommended value). Schedule-free AdamW (``schedulefree``) keeps an averaged iterate that must be swapped
in for evaluation: :class:`~lightning_hdet.demos.base.DemoModule` does that around validation and at the end of
training. Both packages are in the ``baselines`` extra and imported only when asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

import torch
from lightning.pytorch import LightningModule

from lightning_hdet._checks import check_choice
from lightning_hdet._tensors import is_schedule_free

OPTIMIZERS = ("adamw", "sgd", "prodigy", "schedulefree")
# LR schedules of the shapes and tabular demos (:func:`with_schedule`): a bare optimizer, or cosine annealing to
# zero over the fit (``CosineAnnealingLR``, stepped every optimizer step).
SCHEDULES = ("constant", "cosine")
# The package each optional optimizer comes from, and what to install.
_OPTIONAL = {"prodigy": ("prodigyopt", "Prodigy"), "schedulefree": ("schedulefree", "AdamWScheduleFree")}


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``name`` (one of :data:`OPTIMIZERS`) over ``params``; SGD uses momentum 0.9."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    check_choice("optimizer", name, OPTIMIZERS)
    module, cls = _OPTIONAL[name]
    try:
        package = importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"optimizer={name!r} needs the `{module}` package: pip install {module} (or the `bench` extra)"
        ) from err
    return getattr(package, cls)(params, lr=lr, weight_decay=weight_decay)


def with_schedule(optimizer: torch.optim.Optimizer, scheduler: str, module: LightningModule) -> object:
    """What ``module.configure_optimizers`` returns for ``scheduler`` (one of :data:`SCHEDULES`): the bare
    optimizer (``"constant"``, as many modules do), or it with ``CosineAnnealingLR`` over the fit's
    ``estimated_stepping_batches``, stepped every step (``"cosine"``), so a strategy sees a real scheduler."""
    if scheduler == "constant":
        return optimizer  # no trainer needed: a bare optimizer can be made outside a fit
    check_choice("scheduler", scheduler, SCHEDULES)
    total = max(int(module.trainer.estimated_stepping_batches), 1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


def set_schedule_free_mode(module: LightningModule, train: bool) -> None:
    """Switch schedule-free optimizers between their training and averaged (evaluation) weights."""
    for opt in module.trainer.optimizers:
        swap = getattr(opt, "train" if train else "eval", None)
        if callable(swap) and is_schedule_free(opt):
            swap()
