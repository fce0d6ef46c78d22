"""``Fabric(strategy="async_local_sgd")`` and ``"diloco"``: the exchange of the Trainer's async strategy, for loops.

The same worker, outer state and server as :class:`~lightning_hdet.asynchronous.lightning.strategy.AsyncLocalSGDStrategy`,
wired by the same :class:`~lightning_hdet.asynchronous.exchange.exchange.Exchange` and configured by the same
:class:`~lightning_hdet.asynchronous.outer.state.OuterSettings`. The model is never wrapped in DDP; the loop runs
inside :meth:`AsyncLocalSGDFabricStrategy.training`, and each ``optimizer.step()`` counts one inner step and,
at the end of the worker's round, exchanges with the outer optimizer on rank 0 (as torchft's ``LocalSGD`` wraps the
optimizer step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Optional

import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_names, own_arguments
from lightning_hdet._compat import DDP_OPTIONS, register_names, strategy_timeout, sync_module_states
from lightning_hdet._process_groups import destroy_default_group_at_exit, destroy_groups
from lightning_hdet.asynchronous.exchange.exchange import Exchange
from lightning_hdet.asynchronous.lightning.worker_shape import check_exchange_options
from lightning_hdet.asynchronous.outer.lookahead import refuse_lookahead
from lightning_hdet.asynchronous.outer.momentum import refuse_moved
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.messages import Kind
from lightning_hdet.asynchronous.wire.network import check_transport

_CODEC_OPTIONS = ("compression", "error_feedback", "pull_compression")


class AsyncLocalSGDFabricStrategy(FabricDDPStrategy):
    """Asynchronous Local-SGD (``mode="async"``) or synchronous DiLoCo (``mode="sync"``) for a Fabric loop.

    Args:
        **kwargs: the Trainer strategy's outer-optimizer, codec and transport arguments, the same objects
            (``local_steps=AdaptiveSteps(...)``, ``mode``, ``outer=DelayedNesterov(...)``, ``compression=Int8()``,
            ``check_pushes``, ``transport``, ... see
            :class:`~lightning_hdet.asynchronous.lightning.strategy.AsyncLocalSGDStrategy`), then
            Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`'s own arguments (``timeout`` also bounds
            every exchange, so it must exceed the longest round); not DistributedDataParallel's options: the model
            is never wrapped in DDP.

    Example::

        model, optimizer = fabric.setup(model, optimizer)
        with fabric.strategy.training(max_steps=1000):  # a sample budget: 1000 x world_size inner steps in all
            for batch in loader:
                if fabric.strategy.should_stop:
                    break
                fabric.backward(loss_of(model, batch))
                optimizer.step()  # exchanges at the end of this worker's round
                optimizer.zero_grad()
        # every rank now holds the global model; fabric.save writes it
    """

    strategy_name = "async_local_sgd"

    def __init__(self, **kwargs: Any) -> None:
        names = [f.name for f in fields(OuterSettings)]
        refuse_moved(type(self).__name__, kwargs)
        check_names(type(self).__name__, kwargs, (*names, *_CODEC_OPTIONS, "transport"),
                    {"Fabric DDPStrategy": own_arguments(FabricDDPStrategy)},
                    "The model is never wrapped in DistributedDataParallel here, so its options do nothing."
                    if set(kwargs) & set(DDP_OPTIONS) else "")
        self.outer_settings = OuterSettings(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        refuse_lookahead(self.outer_settings.outer, "Fabric", "Fabric has no validation loop to score candidates with.")
        self._codecs = {k: kwargs.pop(k) for k in list(kwargs) if k in _CODEC_OPTIONS}
        self.transport = check_transport(kwargs.pop("transport", None))
        if self.outer_settings.stagger > 1:
            raise ValueError(f"`stagger={self.outer_settings.stagger}` is not supported by {type(self).__name__}:"
                             " staggered parts travel in overlapped exchanges (`overlap_steps`), which the Fabric loop"
                             " does not run. Use stagger=1, or the Trainer's AsyncLocalSGDStrategy.")
        push, pull, feedback = check_exchange_options(self.outer_settings, self._codecs.get("compression", "none"),
                                                      self._codecs.get("error_feedback"),
                                                      self._codecs.get("pull_compression", "none"))
        self._codecs = dict(compression=push, pull_compression=pull, error_feedback=feedback,
                            outer_optimizer=self.outer_settings.outer)
        super().__init__(**kwargs)
        self._groups: Optional[tuple[Any, Any]] = None
        self._module: Optional[Module] = None
        self._optimizers: list[Optimizer] = []
        self._exchange: Optional[Exchange] = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the async and DiLoCo names (subprocess, spawn and fork launchers) in Fabric's registry."""
        register_names(strategy_registry, cls, [
            (f"{base}{suffix}", f"{'Asynchronous Local-SGD' if mode == 'async' else 'DiLoCo'} for Fabric, "
             f"start_method '{method}'", {"mode": mode, "start_method": method})
            for base, mode in (("async_local_sgd", "async"), ("diloco", "sync"))
            for suffix, method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"))
        ])

    @override
    def _configure_launcher(self) -> None:
        workers = self.num_nodes * self.num_processes
        if workers < 2:
            raise ValueError(f"{type(self).__name__} needs at least 2 processes (got devices={self.num_processes}, "
                             f"num_nodes={self.num_nodes}); use a single-device strategy for one process.")
        self.outer_settings.outer.check_workers(workers)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        timeout = strategy_timeout(self)
        self._groups = (dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout))
        destroy_default_group_at_exit()  # and every group built on it (Lightning does it for NCCL only)

    @override
    def teardown(self) -> None:
        groups, self._groups = self._groups, None
        destroy_groups(groups or ())
        super().teardown()

    @override
    def setup_module(self, module: Module) -> Module:
        """No DDP wrapper (gradients are never all-reduced); every worker starts from rank 0's model."""
        self._module = module
        sync_module_states(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    # ------------------------------------------------------------------ the loop
    @contextmanager
    def training(self, max_steps: Optional[int] = None) -> Iterator[AsyncLocalSGDFabricStrategy]:
        """Join the exchange for the block's training (``max_steps``: the budget per worker on average; ``None``:
        until the block ends); on leaving, every rank holds the global model."""
        if self._module is None or len(self._optimizers) != 1:
            raise ValueError(f"{type(self).__name__}.training needs `fabric.setup(model, optimizer)` with exactly one "
                             f"(inner) optimizer first, got {len(self._optimizers)} optimizer(s).")
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"`max_steps` must be a positive integer or None, got {max_steps!r}.")
        module, device, workers = self._module, self.root_device, self.world_size
        budget = workers * max_steps if max_steps is not None else None
        outer = Exchange.start_outer(self.outer_settings, module, device, workers, budget, None) \
            if self.is_global_zero else None
        assert self._groups is not None
        self._exchange = Exchange(module, device, self._groups, workers, strategy_timeout(self).total_seconds(),
                                  None, outer, **self._codecs, transport=self.transport)
        self._exchange.worker.exchange(Kind.HELLO)
        try:
            yield self
            self._exchange.leave(stop_everyone=False)  # no goodbye after an error: the other ranks may be gone
            sync_module_states(module)  # rank 0 holds the global model: every rank takes it
        finally:
            # On every path: rank 0's server threads stopped, the groups' references dropped (their native
            # threads end only with the last one; a gloo thread alive at interpreter exit can abort it).
            exchange, self._exchange = self._exchange, None
            exchange.close()

    @property
    def should_stop(self) -> bool:
        """The outer side said stop (the budget is spent): leave the loop."""
        return self._exchange is not None and self._exchange.worker.stopped

    @property
    def outer_updates(self) -> int:
        """How many times the outer optimizer has stepped (rank 0, inside :meth:`training`; 0 elsewhere)."""
        outer = self._exchange.outer if self._exchange is not None else None
        return outer.outer_updates if outer is not None else 0

    @property
    def rounds(self) -> list[tuple[int, int]]:
        """This worker's exchanges in the current block: ``(local_steps_assigned, outer_updates_seen)``."""
        return self._exchange.worker.rounds if self._exchange is not None else []

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """One inner step; at the end of this worker's round, one exchange (push, then pull the global model)."""
        output = super().optimizer_step(optimizer, **kwargs)
        exchange = self._exchange
        if exchange is not None and not exchange.worker.stopped and exchange.worker.step():
            exchange.worker.exchange(Kind.PUSH)
        return output

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """Inside :meth:`training`, rank 0 saves the current global model (what rank 0 writes); else the module's."""
        exchange = self._exchange
        if exchange is not None and exchange.outer is not None and module is self._module:
            with exchange.global_model():
                return {k: v.clone() for k, v in module.state_dict().items()}
        return super().get_module_state_dict(module)
