"""FSDP2 helpers that both ``"hdet_fsdp"`` (:mod:`lightning_hdet.hdet.fsdp`) and FSDP2 inside async workers
(:mod:`lightning_hdet.asynchronous.exchange.worker_shards`) use: which submodules to shard, sharding, and freeing gathered
parameters. No Lightning and no process group of their own: the mesh is given."""

from __future__ import annotations

from typing import Any, Callable, Union

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn import Module

#: Which submodules become FSDP units: a set of module classes, or a predicate on each submodule.
ShardingPolicy = Union[set[type[Module]], Callable[[Module], bool], None]


def is_sharded(module: Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or one of its submodules (e.g. in ``configure_model``)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard(module: Module, mesh: DeviceMesh, policy: ShardingPolicy, **fsdp_kwargs: Any) -> None:
    """``fully_shard`` every submodule the policy picks (innermost first), then the root."""
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        policy = lambda m: isinstance(m, classes)  # noqa: E731
    if policy is not None:
        picked = [m for m in module.modules() if m is not module and policy(m)]
        for sub in reversed(picked):  # children before parents, as fully_shard requires
            fully_shard(sub, mesh=mesh, **fsdp_kwargs)
    fully_shard(module, mesh=mesh, **fsdp_kwargs)


def reshard(module: Module) -> None:
    """Free FSDP2's unsharded parameters, so the shards are what the next forward gathers. Why: a module FSDP2
    treats as a root (e.g. a submodule called directly from ``validation_step``) keeps its gathered parameters
    after a forward without backward; writing the shards under it would leave the next forward on stale values."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
