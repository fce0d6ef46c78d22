"""HDETStrategy: data-parallel replicas split into groups that train with different learning rates.

A thin subclass of Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`. It adds

* one process group per HDET group (created identically on every rank),
* a per-group learning-rate multiplier applied around every optimizer step, so the scheduler never sees it,
* the collectives the :class:`~lightning_hdet.hdet.callback.HDETCallback` builds on: gathering one row of numbers per
  group and merging (blending) the groups' parameters with one collective of the model's size,
* an optional guard that skips the optimizer step of a group whose loss or gradients are non-finite,
* checkpoints whose ``state_dict`` is the merged model, plus every group's own state for an exact resume.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._compat import (
    StrategyRegistry,
    ddp_process_group,
    ensure_callback,
    has_user_comm_hook,
    register_names,
    set_ddp_process_group,
    strategy_timeout,
    sync_module_states,
    unwrap_optimizer,
)
from lightning_hdet._tensors import assign_flat, flatten, model_state, to_cpu
from lightning_hdet.hdet.layout import check_multipliers, check_num_groups, check_spread, fan_out
from lightning_hdet.hdet.layout import GroupLayout
from lightning_hdet.hdet.guard import FiniteGuard, grads_are_finite

GradientSync = Literal["global", "group"]
_GRADIENT_SYNC = ("global", "group")
# Extra keyword arguments DDPStrategy forwards to torch's DistributedDataParallel; HDET owns `process_group`.
_DDP_KWARGS = tuple(sorted(set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "process_group"}))


class _SkipStep(Exception):
    """Raised from inside the closure to skip an optimizer step before it touches any state."""


class HDETStrategy(DDPStrategy):
    """Data parallelism with groups of replicas that train with different learning rates.

    Args:
        num_groups: number of groups (the ensemble's members). ``None``: one group per rank (the published setting).
            Ranks are split into contiguous groups of equal size.
        lr_multipliers: one learning-rate multiplier per group, applied to every learning rate the optimizer and
            schedulers produce. ``None``: the symmetric fan-out set by ``spread``.
        spread: half-width of the published fan-out ``1 + spread * (g - (G-1)/2) / max((G-1)/2, 0.5)``, in ``[0, 1)``.
            ``0`` is plain DDP.
        gradient_sync: ``"global"``: gradients averaged over all ranks every step (published; groups differ only in
            step size). ``"group"``: each group is its own DDP job on its own process group, so groups diverge
            between merges.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` accepts.
    """

    strategy_name = "hdet"

    def __init__(
        self,
        num_groups: Optional[int] = None,
        lr_multipliers: Optional[Sequence[float]] = None,
        spread: float = 1 / 9,
        gradient_sync: GradientSync = "global",
        **kwargs: Any,
    ) -> None:
        if num_groups is not None:
            check_num_groups(num_groups)
        check_spread(spread)
        if gradient_sync not in _GRADIENT_SYNC:
            raise ValueError(f"`gradient_sync` must be one of {_GRADIENT_SYNC}, got {gradient_sync!r}.")
        if lr_multipliers is not None:
            lr_multipliers = check_multipliers(lr_multipliers)
            if num_groups is not None and len(lr_multipliers) != num_groups:
                raise ValueError(
                    f"`lr_multipliers` has {len(lr_multipliers)} values but `num_groups={num_groups}`; "
                    "give exactly one multiplier per group."
                )
        _check_ddp_kwargs(kwargs)
        super().__init__(**kwargs)
        self._requested_groups = num_groups
        self._requested_multipliers = lr_multipliers
        self.spread = spread
        self.gradient_sync = gradient_sync
        self._layout: Optional[GroupLayout] = None
        self._group_pgs: list[Any] = []
        self._multipliers: Optional[Tensor] = None  # [num_groups, num_param_groups], float64 on the host
        self._guard: Optional[FiniteGuard] = None
        self.guard_nonfinite = False
        self.skipped_steps = 0

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_strategies(cls, strategy_registry: StrategyRegistry) -> None:
        """Register ``"hdet"`` (subprocess launcher) and ``"hdet_spawn"`` without replacing existing entries."""
        register_names(strategy_registry, cls, [
            (name, f"HDET strategy with `start_method` '{method}'", {"start_method": method})
            for name, method in (("hdet", "popen"), ("hdet_spawn", "spawn"))
        ])

    def connect(self, model: LightningModule) -> None:
        """Attach the model; install a default :class:`~lightning_hdet.hdet.callback.HDETCallback` if none was passed."""
        super().connect(model)
        from lightning_hdet.hdet.callback import HDETCallback  # the callback imports this module

        ensure_callback(model, HDETCallback)

    @property
    def config(self) -> dict[str, Any]:
        """The HDET settings, as recorded in the logger's run config under ``hdet/...``."""
        return {
            "num_groups": self.num_groups,
            "group_size": self.layout.group_size,
            "lr_multipliers": self.lr_multipliers[:, 0].tolist(),
            "spread": self.spread,
            "gradient_sync": self.gradient_sync,
        }

    # ------------------------------------------------------------------ layout and process groups
    def _configure_launcher(self) -> None:
        # Runs when the Trainer is built, before any process or process group exists: validate the layout here.
        self._layout = self._make_layout(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    def _make_layout(self, world_size: int) -> GroupLayout:
        if world_size == 1:
            rank_zero_warn(
                "HDETStrategy needs several data-parallel replicas to form groups; with a single process it trains "
                "as plain Lightning would (one group, multiplier 1)."
            )
            self._requested_multipliers = None
            self.spread = 0.0
            return GroupLayout(1, 1)
        groups = self._requested_groups
        if groups is None:
            groups = len(self._requested_multipliers) if self._requested_multipliers is not None else world_size
        layout = GroupLayout(world_size, groups)
        if self._requested_multipliers is not None and len(self._requested_multipliers) != groups:
            raise ValueError(
                f"`lr_multipliers` has {len(self._requested_multipliers)} values for {groups} groups; "
                "give exactly one multiplier per group."
            )
        if self.num_nodes > 1 and layout.crosses_nodes(self.num_processes):
            rank_zero_warn(
                f"HDET groups of {layout.group_size} ranks straddle nodes of {self.num_processes} processes; "
                "choose `num_groups` so the group size divides the processes per node to keep traffic local."
            )
        return layout

    @property
    def layout(self) -> GroupLayout:
        if self._layout is None:
            self._layout = self._make_layout(self.world_size)
        return self._layout

    def setup_distributed(self) -> None:
        super().setup_distributed()
        rank_zero_info(f"HDET: creating {self.layout.num_groups} process groups of {self.layout.group_size} ranks")
        # Every rank must create every group, in the same order.
        self._group_pgs = [
            dist.new_group(self.layout.ranks(g), timeout=strategy_timeout(self)) for g in range(self.layout.num_groups)
        ]

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def group_index(self) -> int:
        """The group this rank belongs to."""
        return self.layout.group_of(self.global_rank)

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's group."""
        return self.layout.ranks(self.group_index)

    @property
    def group_process_group(self) -> Any:
        """The process group of this rank's group (``None`` before the distributed setup)."""
        return self._group_pgs[self.group_index] if self._group_pgs else None

    # ------------------------------------------------------------------ learning-rate multipliers
    def _initial_multipliers(self) -> list[float]:
        if self._requested_multipliers is not None:
            return list(self._requested_multipliers)
        return fan_out(self.num_groups, self.spread)

    @property
    def lr_multipliers(self) -> Tensor:
        """Every group's multiplier for every optimizer param group: shape ``(num_groups, num_param_groups)``.

        Param groups added during training (e.g. by fine-tuning callbacks) start with their group's first
        multiplier.
        """
        if self._multipliers is None:
            self._multipliers = torch.tensor(self._initial_multipliers(), dtype=torch.float64)[:, None]
        missing = self.num_param_groups - self._multipliers.shape[1]
        if missing > 0:
            self._multipliers = torch.cat([self._multipliers, self._multipliers[:, :1].expand(-1, missing)], dim=1)
        return self._multipliers.clone()

    @property
    def lr_multiplier(self) -> float:
        """This rank's multiplier for the first param group."""
        return float(self.lr_multipliers[self.group_index, 0])

    def set_lr_multipliers(self, multipliers: Union[Sequence[float], Sequence[Sequence[float]], Tensor]) -> None:
        """Set every group's learning-rate multiplier: ``G`` values (all param groups alike) or a ``G x P`` table.

        This is the one place multipliers change at run time; call it with identical values on every rank.
        """
        table = torch.as_tensor(multipliers, dtype=torch.float64).clone()
        if table.dim() == 1:
            table = table[:, None].expand(-1, max(self.num_param_groups, 1)).clone()
        if table.dim() != 2 or table.shape[0] != self.num_groups:
            raise ValueError(
                f"`multipliers` must have one row per group ({self.num_groups}), got shape {tuple(table.shape)}."
            )
        if not bool(torch.isfinite(table).all()) or bool((table <= 0).any()):
            raise ValueError(f"`multipliers` must be positive and finite, got {table.tolist()}.")
        self._multipliers = table

    def param_group_offset(self, optimizer: Optimizer) -> int:
        """Index of ``optimizer``'s first param group in the flattened list over all optimizers."""
        offset = 0
        for opt in self.optimizers:
            if unwrap_optimizer(opt) is unwrap_optimizer(optimizer):
                return offset
            offset += len(opt.param_groups)
        raise ValueError("The optimizer is not one of the strategy's optimizers.")

    @property
    def num_param_groups(self) -> int:
        return sum(len(opt.param_groups) for opt in self.optimizers)

    @contextmanager
    def scaled_lr(self, optimizer: Optimizer) -> Iterator[None]:
        """Multiply each param group's ``lr`` by this group's multiplier for the duration of one step."""
        offset = self.param_group_offset(optimizer)
        row = self.lr_multipliers[self.group_index]
        saved = [pg["lr"] for pg in optimizer.param_groups]
        try:
            for i, pg in enumerate(optimizer.param_groups):
                pg["lr"] = pg["lr"] * float(row[offset + i])
            yield
        finally:
            for pg, lr in zip(optimizer.param_groups, saved):
                pg["lr"] = lr

    def schedule_lrs(self) -> Tensor:
        """The learning rate the optimizers and schedulers say, per flattened param group (no multiplier)."""
        return torch.tensor([float(pg["lr"]) for opt in self.optimizers for pg in opt.param_groups], dtype=torch.float64)

    def current_lrs(self) -> Tensor:
        """Real learning rate of every group and flattened param group: schedule LR x multiplier, ``(G, P)``."""
        return self.lr_multipliers * self.schedule_lrs()

    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        for i, opt in enumerate(self.optimizers):
            for j, pg in enumerate(opt.param_groups):
                lr = pg.get("lr")
                if isinstance(lr, Tensor):
                    lr = float(lr)
                if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr):
                    raise ValueError(
                        f"HDETStrategy scales each param group's `lr`, but optimizer {i} "
                        f"({type(unwrap_optimizer(opt)).__name__}) param group {j} has lr={pg.get('lr')!r}; "
                        "use an optimizer with a numeric learning rate."
                    )

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        if self.guard_nonfinite:
            closure = self._guarded(closure, optimizer)
        try:
            with self.scaled_lr(optimizer):
                return super().optimizer_step(optimizer, closure, model, **kwargs)
        except _SkipStep:
            self.skipped_steps += 1
            return None
        finally:
            if self._guard is not None:
                self._guard.reset()

    # ------------------------------------------------------------------ safety net: skip non-finite steps
    def _uses_grad_scaler(self) -> bool:
        return isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None

    def _guarded(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        def guarded_closure() -> Any:
            result = closure()
            bad = torch.zeros((), dtype=torch.bool, device=self.root_device)
            if isinstance(result, Tensor):
                bad |= ~torch.isfinite(result.detach()).all()
            if self._guard is not None:
                bad |= self._guard.flag
            elif not self._uses_grad_scaler():
                bad |= ~grads_are_finite(optimizer)
            if self.layout.group_size > 1:
                flag = bad.to(torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group_process_group)
                bad = flag.bool()
            if bool(bad):
                raise _SkipStep
            return result

        return guarded_closure

    # ------------------------------------------------------------------ DDP wrapping
    def _setup_model(self, model: Module) -> Module:
        if self.gradient_sync == "group":
            # Groups are separate DDP jobs: start them all from rank 0's weights, then reduce inside the group.
            sync_module_states(model)
            set_ddp_process_group(self, self.group_process_group)
        return super()._setup_model(model)

    def configure_ddp(self) -> None:
        super().configure_ddp()
        if self.guard_nonfinite and not has_user_comm_hook(self) and not self._uses_grad_scaler():
            pg = ddp_process_group(self)
            size = dist.get_world_size(pg)
            self._guard = FiniteGuard(pg, size, self.root_device)
            self.model.register_comm_hook(self._guard, FiniteGuard.hook)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ collectives used by the callback
    def gather_group_values(self, values: Tensor) -> Tensor:
        """Sum ``values`` (1-D, this rank's numbers) over the ranks of each group; return ``(num_groups, k)``.

        One small all-reduce over all ranks; every rank gets every group's row.
        """
        values = values.to(self.root_device, torch.float64).reshape(-1)
        table = torch.zeros(self.num_groups, values.numel(), dtype=torch.float64, device=self.root_device)
        table[self.group_index] = values
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(table)
        return table.cpu()

    def merge(self, coefficients: Sequence[float], strengths: Sequence[float]) -> Tensor:
        """Blend the groups' parameters and floating-point buffers.

        ``target = sum_g coefficients[g] * theta_g`` (one all-reduce of the model's size over all ranks); then each
        group moves ``theta_g <- (1 - strengths[g]) * theta_g + strengths[g] * target``. A group whose coefficient is
        0 contributes zeros, so non-finite parameters of a diverged group never reach the target.
        Returns the flat target on the host.
        """
        tensors = model_state(self.lightning_module)
        target = self._blend_target(tensors, coefficients)
        assign_flat(tensors, target, float(strengths[self.group_index]))
        return target.cpu()

    def _blend_target(self, tensors: list[Tensor], coefficients: Sequence[float]) -> Tensor:
        coefficient = float(coefficients[self.group_index]) / self.layout.group_size
        flat = flatten(tensors)
        if coefficient == 0.0:
            flat.zero_()
        else:
            flat.mul_(coefficient)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flat)
        return flat

    def load_flat(self, flat: Tensor) -> None:
        """Overwrite the parameters and floating-point buffers with a flat vector (e.g. a host backup)."""
        assign_flat(model_state(self.lightning_module), flat.to(self.root_device), 1.0)

    def flat_state(self) -> Tensor:
        """This rank's parameters and floating-point buffers as one flat vector."""
        return flatten(model_state(self.lightning_module))

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after wrapping: DDP's initial broadcast would otherwise overwrite each group's own weights."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The merged model: the mean over groups whose parameters are finite (a collective on every rank)."""
        module = self.lightning_module
        if self.num_groups == 1 or not dist.is_initialized():
            return module.state_dict()
        tensors = model_state(module)
        finite = torch.tensor([float(bool(torch.isfinite(flatten(tensors)).all()))])
        healthy = self.gather_group_values(finite)[:, 0] > 0
        if not bool(healthy.any()):
            healthy = torch.ones_like(healthy)
        target = self._blend_target(tensors, (healthy.double() / healthy.sum()).tolist())
        merged: dict[int, Tensor] = {}
        offset = 0
        for t in tensors:
            merged[id(t)] = target[offset : offset + t.numel()].view_as(t).to(t.dtype).clone()
            offset += t.numel()
        return {k: merged.get(id(v), v.detach()) for k, v in module.state_dict(keep_vars=True).items()}

    def ensemble_state(self) -> Optional[list[dict[str, Any]]]:
        """Every group's own parameters and optimizer states, gathered on rank 0 (``None`` elsewhere)."""
        leader = self.global_rank == self.group_ranks[0]
        mine = None
        if leader:
            mine = {
                "state_dict": {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()},
                "optimizer_states": [to_cpu(unwrap_optimizer(opt).state_dict()) for opt in self.optimizers],
            }
        gathered: Optional[list[Any]] = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(mine, gathered, dst=0)
        if not self.is_global_zero:
            return None
        return [gathered[self.layout.ranks(g)[0]] for g in range(self.num_groups)]  # type: ignore[index]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's reader, with a clear error for a truncated or corrupted file."""
        return read_checkpoint(lambda: super(HDETStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only),
                               checkpoint_path)

    def _own_group_state(self, checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
        hdet = checkpoint.get("hdet") or {}
        groups = hdet.get("groups")
        if not groups:
            return None
        if len(groups) != self.num_groups:
            rank_zero_warn(
                f"The checkpoint holds {len(groups)} HDET groups but this run has {self.num_groups}; every group "
                "starts from the checkpoint's merged model and a fresh optimizer state."
            )
            return None
        return groups[self.group_index]

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        own = self._own_group_state(checkpoint)
        if own is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.lightning_module.load_state_dict(own["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        own = self._own_group_state(checkpoint)
        hdet_groups = (checkpoint.get("hdet") or {}).get("groups")
        if own is None and hdet_groups:
            return  # re-sharded resume: fresh optimizer state for every group
        if own is None:
            return super().load_optimizer_state_dict(checkpoint)
        super().load_optimizer_state_dict({"optimizer_states": own["optimizer_states"]})

    def teardown(self) -> None:
        self._guard = None
        super().teardown()


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    """Reject keyword arguments that DistributedDataParallel would only refuse after the process groups exist.

    Sharded strategies' options (FSDP's ``sharding_strategy``, DeepSpeed's ``stage``/``offload_optimizer``, ...)
    land here: HDET needs a full model replica on every rank, because groups merge by averaging whole parameters.
    """
    own = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    for name in kwargs:
        if name == "process_group":
            if kwargs[name] is not None:
                raise ValueError(
                    "`process_group` cannot be passed to HDETStrategy: it creates the process groups itself "
                    "(one per HDET group)."
                )
        elif name not in own and name not in _DDP_KWARGS:
            raise ValueError(
                f"HDETStrategy got an unsupported argument `{name}`={kwargs[name]!r}. Besides its own and "
                f"DDPStrategy's arguments it accepts only DistributedDataParallel options: {', '.join(_DDP_KWARGS)}. "
                "Sharded training (FSDP/DeepSpeed options) is not supported: every rank holds a full replica."
            )
