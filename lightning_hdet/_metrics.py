"""The torchmetrics objects of a module, known by duck type (the package's code never imports torchmetrics): HDET
syncs them over each group (``hdet/lightning/metric_sync``), async makes them local while the workers train apart
(``asynchronous/lightning/local_metrics``)."""

from __future__ import annotations

from torch.nn import Module


def torchmetrics_in(module: Module | None) -> list[Module]:
    """Every torchmetrics ``Metric`` in ``module`` (itself included), known by ``distributed_available_fn``, the
    switch ``Metric`` consults before its every sync; none without a module."""
    if module is None:
        return []
    return [m for m in module.modules() if callable(getattr(m, "distributed_available_fn", None))]
