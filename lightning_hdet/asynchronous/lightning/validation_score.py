"""What scores a :class:`~..outer.lookahead.LookaheadLR`'s candidates on rank 0: the user's own ``validation_step``
on a copy of the module holding the candidate global model, over the first validation batches, reading the metric it
logs. A copy, because the outer side steps while rank 0's module trains: remote pushes in the thread that receives
them, rank 0's own in its training thread (which then waits for the scoring)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_hdet._compat import validation_loaders
from lightning_hdet._tensors import float_buffers, write_from
from lightning_hdet.asynchronous.exchange.exchange import read_model
from lightning_hdet.asynchronous.lightning.local_metrics import make_metrics_local
from lightning_hdet.asynchronous.outer.lookahead import LookaheadLR, Score


class ValidationScore:
    """``score(params, buffers)``: the mean of what ``validation_step`` logs as ``monitor`` over ``batches`` (already
    on ``device``), with the flat global ``params`` and ``buffers`` written into ``model`` (a copy, in eval mode);
    negated with ``mode="max"`` (the lookahead keeps the lowest score)."""

    def __init__(self, model: pl.LightningModule, batches: list[Any], monitor: str, device: torch.device,
                 mode: str = "min") -> None:
        self.model, self.batches, self.monitor, self.device = model, batches, monitor, device
        self.sign = 1.0 if mode == "min" else -1.0
        self._params, self._buffers = list(model.parameters()), float_buffers(model)
        self._logged: dict[str, Any] = {}
        make_metrics_local(model)  # rank 0 scores alone
        # the copy has no trainer to log into: what it logs is read here (log_dict calls log)
        model.log = self._log  # type: ignore[method-assign]

    def _log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self._logged[name] = value

    @torch.no_grad()
    def __call__(self, params: Tensor, buffers: Tensor) -> float:
        write_from(self._params, params, self.device)
        write_from(self._buffers, buffers, self.device)
        total = torch.zeros((), device=self.device)
        for index, batch in enumerate(self.batches):
            self._logged.clear()
            self.model.validation_step(batch, index)
            if self.monitor not in self._logged:
                raise ValueError(f"`LookaheadLR(monitor={self.monitor!r})`: your validation_step did not log"
                                 f" {self.monitor!r} (it logged {sorted(self._logged) or 'nothing'}). Set monitor to"
                                 " the loss it logs, e.g. self.log('val_loss', loss).")
            value = self._logged[self.monitor]
            if hasattr(value, "compute"):  # a torchmetrics Metric: this batch's value, then a fresh start
                value, _ = value.compute(), value.reset()
            total += torch.as_tensor(value, device=self.device).detach().float().mean()
        return self.sign * float(total) / len(self.batches)  # one device-to-host copy per candidate


def validation_score(module: pl.LightningModule, options: LookaheadLR | None, device: torch.device,
                     to_device: Callable[[Any], Any]) -> Score | None:
    """Rank 0, at the start of fit: the lookahead's score (``None`` without a lookahead), tried once on the initial
    model so that a missing metric or validation set stops the run before its first round."""
    if options is None:
        return None
    trainer = module.trainer
    stage, trainer.validating = trainer.state.stage, True  # the sampler and the transfer hooks see validation
    try:
        # no validation data (Lightning's own error for it names neither the lookahead nor the fix): none to score on
        loaders = validation_loaders(trainer) if trainer.enable_validation else []
        if len(loaders) != 1:
            raise ValueError(f"`lookahead` scores candidate outer lrs on your validation data: give the Trainer one"
                             f" val_dataloader (got {len(loaders)}), and keep validation on (limit_val_batches > 0).")
        batches = [to_device(batch) for batch in itertools.islice(loaders[0], options.batches)]
    finally:
        trainer.state.stage = stage
    if not batches:
        raise ValueError("`lookahead` scores on the first validation batches, and the val_dataloader is empty.")
    model = copy.deepcopy(module, memo={id(trainer): None})  # not the Trainer: the copy only runs validation_step
    if getattr(model, "_compiler_ctx", None):  # torch.compile'd: its step methods are the original's, bound to it
        for name in ("forward", "training_step", "validation_step", "test_step", "predict_step"):
            model.__dict__.pop(name, None)
    model.eval()
    score = ValidationScore(model, batches, options.monitor, device, options.mode)
    score(*read_model(module, device))
    return score
