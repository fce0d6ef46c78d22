"""FSDP2 pieces of ``"hdet_fsdp"`` that need no Lightning: the groups' shared gradient, local shards (sharding a
module is :mod:`lightning_hdet._sharding`, shared with async workers).

Every HDET group is one FSDP2 shard group: ``fully_shard(..., mesh=mesh["shard"])`` on a ``(group, shard)`` device
mesh, so rank ``(g, k)`` holds shard ``k`` of every parameter of group ``g``. The ranks that hold the same shard
in different groups form the ``"group"`` dimension of the mesh; merges and the shared gradient of
``gradient_sync="global"`` are collectives over that dimension on the local shards, never on full parameters.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module

from lightning_hdet._tensors import float_buffers, local
from lightning_hdet.hdet.execution.comm import Communicator


def check_mesh(module: Module, mesh: DeviceMesh) -> None:
    """Every parameter must be a DTensor sharded on this group's shard mesh (not the 2-D mesh, not unsharded)."""
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            raise ValueError(
                f"Parameter `{name}` is not sharded: with `fully_shard` in `configure_model`, shard the root module "
                "too (`fully_shard(self, mesh=self.device_mesh['shard'])`), or leave sharding to the strategy."
            )
        if p.device_mesh != mesh:
            raise ValueError(
                f"Parameter `{name}` is sharded on {p.device_mesh}; HDET groups shard on `self.device_mesh['shard']` "
                "(the groups' shared gradient and merges are the strategy's job, not FSDP's)."
            )


def local_shards(module: Module) -> list[Tensor]:
    """This rank's shard of every parameter, in ``parameters()`` order (views: writing them writes the model)."""
    return [local(p.detach()) for p in module.parameters()]


def shard_state(module: Module) -> list[Tensor]:
    """What a merge carries on this rank: the local parameter shards, then the (unsharded) float buffers."""
    return local_shards(module) + float_buffers(module)


class GroupGradientMean:
    """FSDP2 all-reduce hook of ``gradient_sync="global"``: each group's reduced gradient shard is averaged with
    the same shard of the other groups (HSDP done by HDET, so that it can guard it).

    With ``guard``, a shard that is not finite is replaced with zeros before it leaves the rank and ``flag``
    records it (a device tensor: no host sync in the backward pass), so a diverging group cannot poison the
    others' gradients; its own step is skipped by the strategy. The mean goes through ``comm``.
    """

    def __init__(self, group: Any, num_groups: int, device: torch.device, guard: bool, comm: Communicator) -> None:
        self.group = group
        self.comm = comm
        self.scale = 1.0 / num_groups
        self.guard = guard
        self.flag = torch.zeros((), dtype=torch.bool, device=device)

    def __call__(self, output: Tensor) -> None:
        output.mul_(self.scale)
        if self.guard:
            bad = ~torch.isfinite(output).all()
            torch.logical_or(self.flag, bad, out=self.flag)
            output.masked_fill_(bad, 0.0)
        self.comm.all_reduce(output, self.group)

    def reset(self) -> None:
        self.flag.zero_()


def set_all_reduce_hook(module: Module, hook: Optional[GroupGradientMean]) -> None:
    """Install ``hook`` on every FSDP2 module of ``module`` (``None``: no hook, each group reduces on its own)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(hook)  # type: ignore[arg-type]  # None is torch's own default (no hook)


@torch.no_grad()
def broadcast_from_first_group(module: Module, group: Any, comm: Communicator) -> None:
    """Give every group group 0's local parameter shards (``group``: the ranks holding the same shard in every
    group) and rank 0's buffers (FSDP2 broadcasts nothing), through ``comm``."""
    for t in local_shards(module):
        comm.broadcast(t, src=0, group=group)
    for b in module.buffers():
        comm.broadcast(b, src=0)
