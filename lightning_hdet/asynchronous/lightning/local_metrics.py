"""torchmetrics objects sync over the world group by themselves, past the strategy's collectives. While the workers
train apart only rank 0 validates and no two workers are at the same step, so such a sync would wait for ranks that
never come (a hang). Made local here, as the strategy's own collectives are
(:class:`~.rank_groups.LocalCollectivesStrategy`)."""

from __future__ import annotations

from collections.abc import Callable

from torch.nn import Module

from lightning_hdet._metrics import torchmetrics_in


def _local() -> bool:
    return False


def make_metrics_local(module: Module | None) -> dict[Module, Callable[[], bool]]:
    """Every torchmetrics object in ``module`` computes from its own rank's state; returns what :func:`restore`
    puts back."""
    saved: dict[Module, Callable[[], bool]] = {}
    for metric in torchmetrics_in(module):
        if metric.distributed_available_fn is not _local:
            saved[metric] = metric.distributed_available_fn
            metric.distributed_available_fn = _local
    return saved


def restore(saved: dict[Module, Callable[[], bool]]) -> None:
    """The metrics sync as before :func:`make_metrics_local` (after fit, every rank validates and tests again)."""
    for metric, sync in saved.items():
        metric.distributed_available_fn = sync
