"""``signal=experimental.Heldout()``: every group scores its averaged parameters on the same held-out batches (Lightning glue).

How the loss is computed (one rule, documented in ``docs/hdet.md``):

* **the batches**: the first ``heldout_batches`` batches of the (first) validation dataloader's *dataset*, read
  in order with the dataloader's ``batch_size`` and ``collate_fn`` (Lightning's per-rank sampler is bypassed:
  under HDET every rank reads its own shard, and the vote needs every group to see the same items). Inside a
  group, rank ``i`` of ``n`` keeps batches ``i, i + n, ...``; they are moved to the device once
  (``strategy.batch_to_device``) and kept there for the whole run. Memory: ``ceil(heldout_batches / n)``
  batches per rank.
* **the loss**: ``heldout_loss(pl_module, batch)`` when the callback got that callable, else the module's own
  method ``pl_module.heldout_loss(batch)``; either returns the batch's mean loss as a one-element tensor and
  logs nothing (``validation_step`` is not called: it logs, and its logs would land in the training loop's
  metrics). The module runs in ``eval()`` mode under ``torch.no_grad()``, on the averaged parameters
  (:class:`~lightning_hdet.hdet.averaging.ParameterAverage`; buffers such as BatchNorm statistics stay the
  current ones).
* **the vote's number**: each group's mean of its batches' losses, summed over the group's ranks through the
  strategy's one ``gather_group_values`` per vote. A fingerprint of the batches (the sum of every number in
  them) travels with it: groups that saw different items raise an error instead of voting on noise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hdet.hdet.averaging import ParameterAverage
from lightning_hdet.hdet.execution.comm import GroupComm

HeldoutLoss = Callable[[LightningModule, Any], Tensor]
WIDTH = 3  # columns of a row: loss sum, batches, fingerprint


class HeldoutScorer:
    """This rank's averaged parameters and held-out batches, and the group losses read from a vote's table."""

    def __init__(self, batches: int, decay: Optional[float], loss: Optional[HeldoutLoss] = None) -> None:
        self.num_batches = batches
        self.decay = decay
        self.loss = loss
        self.average: Optional[ParameterAverage] = None
        self.batches: Optional[list[Any]] = None  # this rank's share, on the device, read at the first vote
        self.fingerprint: Optional[Tensor] = None
        self._last_step = -1

    def start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Average from the current parameters on (a resume restarts the average: it is not checkpointed)."""
        if self.loss is None and not callable(getattr(pl_module, "heldout_loss", None)):
            raise MisconfigurationException(
                f"HDETCallback(signal=Heldout()) needs the held-out loss of a batch: give it "
                f"`Heldout(loss=lambda module, batch: ...)` or define `{type(pl_module).__name__}.heldout_loss(self, "
                "batch)` returning the batch's mean loss as a one-element tensor (without logging)."
            )
        params = [p for p in pl_module.parameters() if p.is_floating_point()]
        if any(type(p.data).__name__ == "DTensor" for p in params):
            raise MisconfigurationException(
                "HDETCallback(signal=Heldout()) averages whole parameters; sharded groups (strategy 'hdet_fsdp') "
                "are not supported yet. Use signal='mean' there."
            )
        self.average = ParameterAverage(params, self.decay)
        self._last_step = trainer.global_step

    def step(self, global_step: int) -> None:
        """Fold this optimizer step's parameters into the average (once per step under gradient accumulation)."""
        if global_step != self._last_step:
            self._last_step = global_step
            self.average.update()

    def restart(self) -> None:
        """After a vote's merge or roll-back: the next interval averages from the new parameters."""
        self.average.restart()

    def row(self, trainer: Trainer, pl_module: LightningModule, groups: GroupComm) -> Tensor:
        """``[loss sum, batches, fingerprint]`` of this rank's share, on the device (its group sums the rows)."""
        if self.batches is None:
            self._cache(trainer, groups)
        device = groups.root_device
        total = torch.zeros((), dtype=torch.float64, device=device)
        modes = {m: m.training for m in pl_module.modules()}
        pl_module.eval()
        try:
            with torch.no_grad(), self.average.swapped_in():
                for batch in self.batches:
                    total += self._batch_loss(pl_module, batch).to(device, torch.float64)
        finally:
            for module, mode in modes.items():
                module.train(mode)
        count = torch.tensor(float(len(self.batches)), dtype=torch.float64).to(device, non_blocking=True)
        return torch.stack([total, count, self.fingerprint.to(device)])

    def _batch_loss(self, pl_module: LightningModule, batch: Any) -> Tensor:
        loss = self.loss(pl_module, batch) if self.loss is not None else pl_module.heldout_loss(batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise MisconfigurationException(
                f"HDETCallback(signal=Heldout()): `Heldout(loss=...)` must return the batch's mean loss as a one-element "
                f"tensor, got {type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}."
            )
        return loss.detach().reshape(())

    def _cache(self, trainer: Trainer, groups: GroupComm) -> None:
        """Read this rank's share of the held-out batches once and keep it on the device."""
        loader = _first_loader(trainer.val_dataloaders)
        if loader is None or not isinstance(loader, DataLoader) or loader.batch_size is None:
            raise MisconfigurationException(
                "HDETCallback(signal=Heldout()) reads its held-out batches from the validation dataloader, but the "
                f"trainer has {'none' if loader is None else 'one without a `batch_size`'} at step "
                f"{trainer.global_step}. Pass `val_dataloaders` to `trainer.fit` (or define `val_dataloader()`), "
                "a `DataLoader` with a `batch_size`, and keep `limit_val_batches` > 0."
            )
        ranks = groups.layout.ranks(groups.group_index)
        position, size = ranks.index(trainer.global_rank), len(ranks)
        plain = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, collate_fn=loader.collate_fn)
        batches = []
        for index, batch in enumerate(plain):
            if index >= self.num_batches:
                break
            if index % size == position:
                batches.append(trainer.strategy.batch_to_device(batch))
        fingerprint = torch.zeros((), dtype=torch.float64, device=groups.root_device)
        for batch in batches:
            apply_to_collection(batch, Tensor, lambda t: fingerprint.add_(t.detach().to(torch.float64).sum()))
        self.batches, self.fingerprint = batches, fingerprint

    @staticmethod
    def read(table: Tensor) -> list[float]:
        """Every group's mean held-out loss from the gathered ``(num_groups, WIDTH)`` table; the groups must have
        scored the same batches (same count and fingerprint)."""
        sums, counts, prints = (table[:, k].tolist() for k in range(WIDTH))
        scale = max(1.0, max(abs(p) for p in prints))
        if len(set(counts)) > 1 or max(prints) - min(prints) > 1e-9 * scale:
            raise MisconfigurationException(
                f"HDETCallback(signal=Heldout()): the groups scored different held-out batches (batches {counts}, "
                f"fingerprints {prints}). The validation dataset must give every rank the same items in the same "
                "order: a map-style dataset, or an iterable one that does not shard itself by rank."
            )
        return [s / c if c > 0 else float("nan") for s, c in zip(sums, counts)]


def _first_loader(loaders: Any) -> Any:
    """The first dataloader of what ``trainer.val_dataloaders`` holds (one, a list or a dict of them)."""
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    if isinstance(loaders, dict):
        return next(iter(loaders.values()), None)
    return loaders
