"""FSDP2 inside a worker of several ranks (``inside_worker="fsdp"``; no Lightning, the groups are given): the
worker's ranks shard the model and inner optimizer state; the exchange still sees one full model. A push gathers one
parameter at a time (every rank takes part) and the leader reads it fragment by fragment; the pulled model is written
back shard-wise, each rank its own rows. No model-sized copy is added on any rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._checks import check_choice
from lightning_hdet._sharding import ShardingPolicy, reshard, shard
from lightning_hdet._tensors import float_buffers, host_buffer, local, numel, read_into, sync_device, write_from
from lightning_hdet.asynchronous.exchange.reshard import shard_rows
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.wire.messages import Fragments
from lightning_hdet.asynchronous.wire.transport import WorkerTransport

if TYPE_CHECKING:
    from lightning_hdet.asynchronous.outer.state import OuterState

#: What may run inside a worker of several ranks.
INSIDE_WORKER = ("ddp", "fsdp")


def check_inside_worker(inside_worker: str, ranks_per_worker: int, checkpoint_inner_states: bool,
                        ddp_kwargs: Sequence[str], auto_wrap_policy: ShardingPolicy = None) -> None:
    """Refuse an ``inside_worker`` that is unknown or would have no effect (before any process group)."""
    check_choice("inside_worker", inside_worker, INSIDE_WORKER,
                 hint="It says how the ranks of a worker train together (DDP: each holds the model; FSDP2: each holds"
                 " 1/k of it).")
    if inside_worker == "ddp":
        if auto_wrap_policy is not None:
            raise ValueError(f"`auto_wrap_policy={auto_wrap_policy!r}` has no effect with `inside_worker='ddp'`: it"
                             " picks FSDP2's units. Use inside_worker='fsdp' (with ranks_per_worker >= 2), or drop it.")
        return
    policy_ok = auto_wrap_policy is None or callable(auto_wrap_policy) or (
        isinstance(auto_wrap_policy, (set, frozenset, list, tuple))
        and all(isinstance(c, type) and issubclass(c, Module) for c in auto_wrap_policy))
    if not policy_ok:
        raise ValueError(f"`auto_wrap_policy={auto_wrap_policy!r}` must be None, a set of torch.nn.Module classes or"
                         " a callable(module) -> bool (the submodules that become FSDP2 units).")
    if ranks_per_worker == 1:
        raise ValueError("`inside_worker='fsdp'` has no effect with `ranks_per_worker=1`: a one-rank worker has nothing"
                         " to shard over. Use ranks_per_worker >= 2 (e.g. the GPUs per node), or drop inside_worker.")
    if checkpoint_inner_states:
        raise ValueError("`checkpoint_inner_states=True` is not supported with `inside_worker='fsdp'`: each rank holds"
                         " a shard of the inner optimizer state, and writes it to its own file beside each checkpoint"
                         " (the default). Drop checkpoint_inner_states.")
    if ddp_kwargs:
        raise ValueError(f"{sorted(ddp_kwargs)} are DDP arguments and have no effect with `inside_worker='fsdp'` (no"
                         " DDP inside the worker). Drop them, or use inside_worker='ddp'.")


def shard_worker(module: Module, group: Any, device_type: str, policy: ShardingPolicy = None) -> None:
    """Shard ``module`` with FSDP2 over ``group``; ``training_step``/``validation_step`` gather too."""
    shard(module, DeviceMesh.from_group(group, device_type), policy)
    for method in ("training_step", "validation_step"):
        register_fsdp_forward_method(module, method)
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
            raise ValueError(f"parameter `{name}` is not sharded on dim 0 by fully_shard: the exchange reads and writes"
                             " FSDP2's default layout only")


def rows(p: DTensor) -> tuple[int, int]:
    return shard_rows(p.shape[0] if p.dim() else 1, p.device_mesh.size(), p.device_mesh.get_local_rank())


@torch.no_grad()
def write_shards(params: Sequence[Tensor], flat: Tensor, device: torch.device) -> None:
    """Each rank copies its rows of every parameter from the flat host buffer ``flat`` into its local shards."""
    offset = 0
    for p in params:
        full = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if isinstance(p, DTensor):
            lo, hi = rows(p)
            local(p).copy_(full[lo:hi], non_blocking=True)
        else:
            p.copy_(full, non_blocking=True)
    sync_device(device)  # ``flat`` may be overwritten next


def read_full(params: Sequence[Tensor], out: Tensor | None, device: torch.device) -> None:
    """Every rank gathers each full parameter in turn; the leader (``out`` given) copies them into ``out``."""
    offset = 0
    for p in params:
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if out is not None:
            read_into([full], out[offset : offset + p.numel()], device)
        offset += p.numel()


def full_pieces(params: Sequence[Tensor], layout: Fragments) -> Iterator[list[Tensor]]:
    """Each fragment's pieces of the full parameters, each gathered once, in order, by every rank."""
    gathered: dict[int, Tensor] = {}
    next_param, offsets = 0, list(itertools.accumulate((p.numel() for p in params), initial=0))

    def gather_upto(end: int) -> None:
        nonlocal next_param
        while next_param < len(params) and offsets[next_param] < end:
            p = params[next_param]
            gathered[next_param] = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).reshape(-1)
            next_param += 1

    for index, fragment in enumerate(layout.fragments):
        # the last fragment also gathers trailing empty parameters: a consumer stops asking after the last one
        gather_upto(fragment.end if index < len(layout.fragments) - 1 else math.inf)
        pieces = []
        for i in sorted(gathered):
            lo, hi = max(fragment.start, offsets[i]), min(fragment.end, offsets[i] + params[i].numel())
            if lo < hi:
                pieces.append(gathered[i][lo - offsets[i] : hi - offsets[i]])
            if offsets[i] + params[i].numel() <= fragment.end:
                del gathered[i]  # no later fragment reads it
        yield pieces


class ShardedWorker(Worker):
    """A :class:`~.worker.Worker` sharded with FSDP2 over ``group``; only the ``leader`` sends."""

    def __init__(self, module: Module, device: torch.device, transport: WorkerTransport, *args: Any,
                 group: Any = None, leader: bool = True, **kwargs: Any) -> None:
        super().__init__(module, device, transport, *args, **kwargs)
        self.group, self.leader = group, leader

    def _messages(self) -> Iterator[Tensor]:
        """The encoded fragments, gathered parameter by parameter (a follower only takes part: it yields nothing)."""
        params = list(self.module.parameters())
        if not self.leader:
            for _ in full_pieces(params, self.layout):
                pass
            return
        for fragment, codec, pieces in zip(self.layout.fragments, self.layout.codecs, full_pieces(params, self.layout)):
            values = read_into(pieces, self.fragment[: fragment.numel], self.device)
            torch.sub(self.pulled[fragment.start : fragment.end], values, out=values)
            yield self._encode(codec, values, fragment.start)

    def _finite(self, buffers: Tensor | None) -> bool:
        """Every rank's shards and buffers are finite: one flag reduced over the worker, so its ranks agree."""
        shards = [local(p.detach()) for p in self.module.parameters()]
        flag = torch.ones((), dtype=torch.int32, device=self.device)
        for t in shards:
            flag.mul_(torch.isfinite(t).all())
        if buffers is not None:
            flag.mul_(bool(torch.isfinite(buffers).all()))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag)

    def write_pulled(self) -> None:
        write_shards(list(self.module.parameters()), self.pulled, self.device)
        write_shards(float_buffers(self.module), self.pulled[self.n_params :], self.device)

    def swap_pulled(self) -> None:
        raise NotImplementedError("rank 0 does not validate during fit with inside_worker='fsdp'")


def read_sharded_model(module: Module, device: torch.device) -> tuple[Tensor, Tensor]:
    """Rank 0: flat host copies of the full parameters (its worker's ranks gather) and the buffers."""
    params, buffers = list(module.parameters()), float_buffers(module)
    full = host_buffer(numel(params), device)
    read_full(params, full, device)
    return full, read_into(buffers, host_buffer(numel(buffers), device), device)


def local_state(obj: Any) -> Any:
    """``obj`` (a nested state dict) with every DTensor replaced by this rank's local shard."""
    if isinstance(obj, DTensor):
        return local(obj.detach()).clone()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_state(v) for v in obj)
    return obj


def sharded_optimizer_state(optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A :func:`local_state` made loadable again; a tensor of another shard's shape is refused."""
    params = {i: p for group, mine in zip(saved["param_groups"], optimizer.param_groups)
              for i, p in zip(group["params"], mine["params"])}

    def restore(i: Any, value: Any) -> Any:
        p = params.get(i)
        if isinstance(p, DTensor) and isinstance(value, Tensor) and value.dim():
            if value.shape == local(p).shape:
                return DTensor.from_local(value.to(local(p).device), p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride(), run_check=False)
            if value.dim() == p.dim():  # never load another rank's (or another k's) rows silently
                raise ValueError(f"a saved state tensor of parameter {i} has shape {tuple(value.shape)}, this rank's"
                                 f" shard {tuple(local(p).shape)}: it was saved with another layout of the worker's"
                                 " ranks")
        return value

    state = {i: {k: restore(i, v) for k, v in entry.items()} for i, entry in saved["state"].items()}
    return {**saved, "state": state}


def state_from_flat(module: Module, params: Tensor, buffers: Tensor) -> dict[str, Any]:
    """The module's state dict with its parameters and float buffers from the flat ``params`` and ``buffers``."""
    values: dict[str, Tensor] = {}
    for named, flat in ((module.named_parameters(), params),
                        (((n, b) for n, b in module.named_buffers() if torch.is_floating_point(b)), buffers)):
        offset = 0
        for name, t in named:
            values[name] = flat[offset : offset + t.numel()].view(t.shape).clone()
            offset += t.numel()
    return {k: values.get(k, v) for k, v in module.state_dict().items()}


@contextmanager
def global_model_shards(module: Module, device: torch.device, outer: OuterState | None, group: Any,
                        src: int, snapshot: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Worker 0's ranks hold their rows of the global model (or ``src``'s ``snapshot`` of it) inside the block
    (streamed from ``src``)."""
    params, buffers = list(module.parameters()), float_buffers(module)
    mine = [local(p.detach()) for p in params] + buffers
    saved = read_into(mine, host_buffer(numel(mine), device), device)
    flats = ((snapshot["params"], snapshot["buffers"]) if snapshot is not None
             else (outer.params, outer.buffers) if outer is not None else (None, None))
    with outer.model_lock if outer is not None and snapshot is None else nullcontext():
        for tensors, flat in zip((params, buffers), flats):
            offset = 0
            for t in tensors:
                full = flat[offset : offset + t.numel()] if flat is not None else torch.empty(t.numel())
                dist.broadcast(full, src=src, group=group)
                write_shards([t], full, device)
                offset += t.numel()
    try:
        yield
    finally:
        reshard(module)  # a forward without backward may leave the global model gathered
        write_from(mine, saved, device)
