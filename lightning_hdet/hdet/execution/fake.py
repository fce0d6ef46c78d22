"""An in-memory HDET world: G groups' parameters as rows of one tensor, one thread per group, no process group.

Each group of a :class:`FakeWorld` is one simulated rank with its own :class:`FakeExecutor` (its strategy), so
:class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` (or a user's own rule) votes, merges, rescues, rolls back
and ends its search exactly as under ``strategy="hdet"``, in milliseconds and against values a test can compute by
hand: :meth:`FakeWorld.run` drives one callback per group in its own thread, as each rank of a real run drives its
own.

Nothing of a merge or a vote is re-implemented here: each rank's ``hdet`` is built from the strategies' own classes
(:class:`~lightning_hdet.hdet.execution.executor.HDETParts`): the :class:`~lightning_hdet.hdet.execution.merge.Merger`
(merges in buckets, the finite check, the restore point, roll-backs, the validation swap) over the group's row of the
world's tensor (:class:`FakeSite`), the :class:`~lightning_hdet.hdet.execution.comm.GroupComm` (the vote's all-reduce),
the :class:`~lightning_hdet.hdet.execution.rates.LearningRates` over the group's own multiplier table and the
:class:`~lightning_hdet.hdet.execution.guard.StepGuard` (its counter set by the test through :meth:`FakeWorld.skip`).
The collectives run on an :class:`InMemoryCommunicator` (every method of
:class:`~lightning_hdet.hdet.execution.comm.Communicator`), which meets the other ranks' threads at a barrier and
combines their tensors in rank order; its process groups are tuples of ranks, so a test can also treat the groups as the
ranks of one strategy (e.g. 2 groups x 2 shards) and run the guard or a checkpoint's reduction over them. The fake adds
optimizer restarts counted per group in ``restarts`` and the executor's contract: every collective is called by every
group with the same arguments in the same order (a mismatch raises ``AssertionError`` naming both calls).
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_hdet.hdet.clusters import Clusters, check_clusters, equal_rows, for_sync, stacked_rows
from lightning_hdet.hdet.execution.comm import GroupComm
from lightning_hdet.hdet.execution.executor import HDETParts
from lightning_hdet.hdet.execution.guard import StepGuard
from lightning_hdet.hdet.execution.merge import Merger, MergePart
from lightning_hdet.hdet.execution.rates import LearningRates
from lightning_hdet.hdet.hyperparams import ONE_MINUS, Explored, ExploredTables
from lightning_hdet.hdet.layout import GroupLayout
from lightning_hdet.hdet.multipliers import MultiplierTable

#: Seconds a group's thread waits for the others at a collective before the run is declared stuck.
TIMEOUT = 30.0


class FakeWorld:
    """Every group's state (see the module docstring).

    Args:
        params: every group's parameters, ``(num_groups, d)`` (or ``d`` values: each group starts from them).
        lr_multipliers: every group's multiplier of the first param group (one per group).
        schedule_lrs: what the optimizers and schedulers say, one per flattened param group.
        gradient_sync: ``"group"``, ``"cluster"`` or ``"global"``, as the strategy's (``clusters``: the groups' clusters,
            at first the groups with equal rates, as the strategy's).
        num_groups: the number of groups when ``params`` is one vector.
        explore: other explored hyperparameters: every group's multiplier of each name (first param group), as
            ``HDETStrategy(explore=...)`` with lists; ``{"lr": 1.0}`` freezes the LR.
        explore_values: what the optimizer says for each explored name, one value per flattened param group
            (default: 1, or 0.5 for a momentum).
    """

    def __init__(self, params: Any, lr_multipliers: Sequence[float], schedule_lrs: Sequence[float] = (0.1,),
                 gradient_sync: str = "group", num_groups: Optional[int] = None,
                 explore: Optional[Mapping[str, Any]] = None,
                 explore_values: Optional[Mapping[str, Sequence[float]]] = None) -> None:
        params = torch.as_tensor(params, dtype=torch.float64)
        if params.dim() == 1:
            params = params[None, :].repeat(num_groups or len(lr_multipliers), 1)
        self.params = params.clone()
        self.num_groups = int(params.shape[0])
        if len(lr_multipliers) != self.num_groups:
            raise ValueError(f"`lr_multipliers` has {len(lr_multipliers)} values for {self.num_groups} groups.")
        self.layout = GroupLayout(self.num_groups, self.num_groups)
        self.explored = ExploredTables(dict(explore or {}), self.num_groups)  # shared: group 0 writes it
        self.explore_values = {n: list(v) for n, v in (explore_values or {}).items()}
        self.schedule = torch.tensor(list(schedule_lrs), dtype=torch.float64)
        self.gradient_sync = gradient_sync
        self.restarts = [0] * self.num_groups  # optimizer-state restarts per group
        self.calls: list[tuple[Any, ...]] = []  # every collective once, in order (group 0's view)
        self._slots: list[Any] = [None] * self.num_groups  # what each rank offers at its current collective
        self._lock = threading.Lock()
        self._barriers: dict[tuple[int, ...], threading.Barrier] = {}  # one per process group (tuple of ranks)
        # Each group's own objects, as each rank's strategy owns its own.
        self.parts = [_parts(self, _Rank(self, g, MultiplierTable(lr_multipliers))) for g in range(self.num_groups)]
        self.clusters = equal_rows(self.parts[0].host.rate_rows())  # (used under gradient_sync="cluster")

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every simulated rank (one per group): the process group ``None`` names."""
        return tuple(range(self.num_groups))

    @property
    def table(self) -> MultiplierTable:
        """Group 0's multiplier table (every group's holds the same values: they are set with the same ones)."""
        return self.parts[0].host.multiplier_table

    @property
    def mergers(self) -> list[Merger]:
        """Every group's :class:`~lightning_hdet.hdet.execution.merge.Merger`."""
        return [p.merger for p in self.parts]

    @property
    def restore_point(self) -> Optional[Tensor]:
        """Group 0's restore point (every group's, after a kept merge: they all hold the same target)."""
        return self.mergers[0].restore_point

    @property
    def initial(self) -> Optional[Tensor]:
        """Group 0's initial model, when the plateau rule keeps it."""
        return self.mergers[0].initial_point

    def executor(self, group: int) -> FakeExecutor:
        """Group ``group``'s view of the world (its one rank's strategy)."""
        return FakeExecutor(self, group)

    def skip(self, group: int, steps: int = 1) -> None:
        """Count ``steps`` optimizer steps of ``group`` as flagged by the guard (its loss or gradient not finite),
        on the guard's own device counter."""
        self.parts[group].guard.counter(torch.device("cpu")).count.add_(steps)

    def run(self, body: Callable[[FakeExecutor], Any]) -> list[Any]:
        """Run ``body(executor)`` for every group at once, one thread each; their results in group order. The first
        error of a group is raised here (the others' threads are released from their barrier)."""
        results: list[Any] = [None] * self.num_groups
        errors: list[BaseException] = []

        def target(g: int) -> None:
            try:
                results[g] = body(self.executor(g))
            except BaseException as error:  # noqa: BLE001 - handed to the caller below
                errors.append(error)
                with self._lock:
                    for barrier in self._barriers.values():
                        barrier.abort()

        threads = [threading.Thread(target=target, args=(g,), name=f"hdet-group{g}") for g in range(self.num_groups)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with self._lock:
            self._barriers.clear()
        if errors:
            raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))
        return results

    def fit(self, make_callback: Callable[[], Any], train_step: Callable[[FakeExecutor, int], Any], max_steps: int,
            save_at: Optional[int] = None, resume: Optional[Sequence[dict[str, Any]]] = None,
            validate: Optional[Callable[[FakeExecutor, int], Optional[dict[str, float]]]] = None,
            **trainer: Any) -> list[tuple[Any, FakeTrainer]]:
        """Train every group ``max_steps`` steps under its own ``make_callback()``, as ``Trainer.fit`` calls a
        callback: ``setup``, ``on_train_start``, then per step ``train_step(executor, step)`` (it moves the group's
        ``executor.params`` and returns the step's loss) and ``on_train_batch_end``, and ``on_train_end``. Returns
        every group's ``(callback, trainer)``; ``trainer`` sets :class:`FakeTrainer` fields.

        ``validate``: after each step's ``on_train_batch_end``, ``validate(executor, step)`` may return the metrics a
        validation logged (``None``: no validation then); they become ``callback_metrics`` between the callback's
        ``on_validation_start`` and ``on_validation_end``, as Lightning's loop runs a validation after that hook.
        ``save_at``: after that step every group writes its checkpoint into ``checkpoints`` (the callback's state,
        what its ``on_save_checkpoint`` adds, the group's parameters), as ``ModelCheckpoint`` after the callback;
        ``resume``: such checkpoints, loaded as ``Trainer.fit(ckpt_path=...)`` does before training goes on."""

        def body(executor: FakeExecutor) -> tuple[Any, FakeTrainer]:
            callback, run = make_callback(), FakeTrainer(executor, max_steps=max_steps, **trainer)
            module = FakeModule()
            callback.setup(run, module, "fit")
            if resume is not None:
                self._load(executor, callback, run, module, resume[executor.group_index])
            callback.on_train_start(run, module)
            for step in range(run.global_step, max_steps):
                loss = torch.as_tensor(train_step(executor, step), dtype=torch.float64)
                run.global_step = step + 1
                callback.on_train_batch_end(run, module, {"loss": loss}, None, step)
                metrics = None if validate is None else validate(executor, run.global_step)
                if metrics is not None:
                    callback.on_validation_start(run, module)
                    run.callback_metrics = {k: torch.tensor(v) for k, v in metrics.items()}
                    callback.on_validation_end(run, module)
                if run.global_step == save_at:
                    checkpoint = {"state": callback.state_dict(), "global_step": run.global_step}
                    callback.on_save_checkpoint(run, module, checkpoint)
                    # a deep copy, as torch.save writes the values of the moment (the restore point is a buffer)
                    self.checkpoints[executor.group_index] = copy.deepcopy({**checkpoint, "params": executor.params})
            callback.on_train_end(run, module)
            return callback, run

        self.checkpoints: list[Optional[dict[str, Any]]] = [None] * self.num_groups
        return self.run(body)

    @staticmethod
    def _load(executor: FakeExecutor, callback: Any, run: FakeTrainer, module: FakeModule,
              checkpoint: dict[str, Any]) -> None:
        """Lightning's order: the callbacks' ``on_load_checkpoint``, their states, then the model."""
        run.ckpt_path, run.global_step = "fake.ckpt", checkpoint["global_step"]
        callback.on_load_checkpoint(run, module, checkpoint)
        callback.load_state_dict(checkpoint["state"])
        executor.params.copy_(checkpoint["params"])

    def barrier(self, ranks: Optional[tuple[int, ...]] = None) -> None:
        """Wait for the threads of ``ranks`` (``None``: every group's; a single rank needs no thread)."""
        ranks = self.ranks if ranks is None else ranks
        if len(ranks) > 1:
            with self._lock:
                barrier = self._barriers.setdefault(ranks, threading.Barrier(len(ranks), timeout=TIMEOUT))
            barrier.wait()

    def exchange(self, group: int, call: tuple[Any, ...], value: Any = None,
                 ranks: Optional[tuple[int, ...]] = None) -> list[Any]:
        """A collective of rank ``group`` over ``ranks`` (``None``: every group): each offers ``value`` under
        ``call`` (the arguments that must match) and gets every one's value, in the order of ``ranks``."""
        ranks = self.ranks if ranks is None else ranks
        self._slots[group] = (call, value)
        self.barrier(ranks)
        offered = [self._slots[r] for r in ranks]
        self.barrier(ranks)  # everybody has read the slots before they are reused
        for g, (other, _) in zip(ranks, offered):
            if not _same(other, call):
                raise AssertionError(f"group {group} called {call} while group {g} called {other}: every rank must "
                                     "call the executor's collectives with the same arguments in the same order.")
        if group == 0:
            self.calls.append(call)
        return [v for _, v in offered]


class FakeExecutor:
    """One group's strategy in a :class:`FakeWorld`: its :class:`~lightning_hdet.hdet.execution.executor.HDETParts`
    (``hdet``, what the callback drives), and what a test's training step reads (``params``, ``current_lrs()``, ...)."""

    def __init__(self, world: FakeWorld, group: int) -> None:
        self.world = world
        self.group = group
        self.hdet = world.parts[group]

    @property
    def group_index(self) -> int:
        return self.group

    @property
    def num_groups(self) -> int:
        return self.world.num_groups

    @property
    def gradient_sync(self) -> str:
        return self.world.gradient_sync

    @property
    def params(self) -> Tensor:
        """This group's parameters (a view of its row of the world's tensor)."""
        return self.world.params[self.group]

    def current_lrs(self) -> Tensor:
        """Every group's real learning rates, ``(num_groups, num_param_groups)``."""
        return self.hdet.table.current_lrs()

    @property
    def explored(self) -> Explored:
        """The other explored hyperparameters' tables, as the strategy's ``explored``."""
        return self.hdet.explored

    def gather_group_values(self, values: Tensor) -> Tensor:
        """Every group's ``values`` as one row: the vote's all-reduce (e.g. to average gradients in a test)."""
        return self.hdet.groups.gather_group_values(values)


def _parts(world: FakeWorld, rank: _Rank) -> HDETParts:
    """One simulated rank's objects: the strategies' own classes over memory, each writer checking that every
    group calls it with the same arguments."""
    comm = InMemoryCommunicator(world, rank.group_index)
    groups = GroupComm(rank, comm)
    merger = _CheckedMerger(FakeSite(world, rank.group_index), groups)
    return HDETParts(rank, groups, _CheckedRates(rank), merger, StepGuard(comm))


class _Rank:
    """One simulated rank of a :class:`FakeWorld`: where it stands (a
    :class:`~lightning_hdet.hdet.execution.comm.Place`), its multiplier table and schedule (a
    :class:`~lightning_hdet.hdet.execution.rates.RateSource`) and what only a strategy does (an
    :class:`~lightning_hdet.hdet.execution.executor.HDETHost`: the gradient switch, its config, its files)."""

    root_device = torch.device("cpu")

    def __init__(self, world: FakeWorld, group: int, table: MultiplierTable) -> None:
        self.world = world
        self.group_index = group
        self.multiplier_table = table

    @property
    def layout(self) -> GroupLayout:
        return self.world.layout

    @property
    def num_groups(self) -> int:
        return self.world.num_groups

    def schedule_lrs(self) -> Tensor:
        return self.world.schedule.clone()

    @property
    def gradient_sync(self) -> str:
        return self.world.gradient_sync

    def set_gradient_sync(self, gradient_sync: str) -> None:
        self.world.exchange(self.group_index, ("set_gradient_sync", gradient_sync))
        self.world.gradient_sync = gradient_sync
        self.world.barrier()  # nobody reads it half-switched

    @property
    def clusters(self) -> Clusters:
        return for_sync(self.world.gradient_sync, self.num_groups, self.world.clusters)

    def set_clusters(self, clusters: Clusters) -> None:
        check_clusters(clusters, self.num_groups)
        self.world.exchange(self.group_index, ("set_clusters", tuple(tuple(c) for c in clusters)))
        if self.group_index == 0 and self.world.gradient_sync == "cluster":
            self.world.clusters = [list(c) for c in clusters]
        self.world.barrier()  # nobody reads them half-written

    def rate_rows(self) -> Tensor:
        columns = len(self.world.schedule)
        return stacked_rows([self.multiplier_table.get(columns), *self.world.explored.get(columns).values()],
                            self.num_groups)

    @property
    def config(self) -> dict[str, Any]:
        return {"num_groups": self.num_groups, "group_size": 1, "gradient_sync": self.gradient_sync, "fake": True}

    def ensemble_files(self) -> dict[str, Any]:
        return {"group_files": None}  # the test keeps every group's checkpoint itself (FakeWorld.fit)

    @property
    def explored(self) -> Explored:
        world = self.world
        tables = world.explored.get(len(world.schedule))
        said = {n: world.explore_values.get(n, [0.5 if n in ONE_MINUS else 1.0] * len(world.schedule)) for n in tables}
        quantity = {n: [1.0 - v if n in ONE_MINUS else v for v in said[n]] for n in tables}
        return Explored(tables, quantity, world.explored.lr)

    def set_explored(self, tables: Any) -> None:
        tables = {n: torch.as_tensor(t, dtype=torch.float64) for n, t in tables.items()}
        flat = torch.cat([t.reshape(-1) for t in tables.values()]) if tables else torch.zeros(0)
        self.world.exchange(self.group_index, ("set_explored", tuple(tables), flat))
        if self.group_index == 0:
            self.world.explored.set(tables, self.num_groups, len(self.world.schedule))
        self.world.barrier()  # nobody reads the tables half-written


class _CheckedRates(LearningRates):
    """:class:`~lightning_hdet.hdet.execution.rates.LearningRates` whose writer is held to the executor's contract."""

    source: _Rank

    def set(self, multipliers: Any) -> None:
        table = torch.as_tensor(multipliers, dtype=torch.float64)
        self.source.world.exchange(self.source.group_index, ("set_lr_multipliers", table))
        super().set(table)


class _CheckedMerger(Merger):
    """:class:`~lightning_hdet.hdet.execution.merge.Merger` whose calls are held to the executor's contract (the merge's
    own
    all-reduces check only their shapes)."""

    site: FakeSite

    def _agree(self, *call: Any) -> None:
        self.site.world.exchange(self.site.group, call)

    def merge(self, coefficients: Sequence[float], strengths: Sequence[float], restart: Sequence[bool],
              keep: bool = True) -> None:
        self._agree("merge", tuple(map(float, coefficients)), tuple(map(float, strengths)),
                    tuple(map(bool, restart)), bool(keep))
        super().merge(coefficients, strengths, restart, keep)

    def ensure_restore_point(self, keep_initial: bool = False) -> None:
        self._agree("ensure_restore_point", bool(keep_initial))
        super().ensure_restore_point(keep_initial)

    def restore(self, initial: Sequence[bool] = ()) -> None:
        self._agree("restore", tuple(map(bool, initial)))
        super().restore(initial)

    def restart_groups(self, initial: Sequence[bool]) -> bool:
        self._agree("restart_groups", tuple(map(bool, initial)))
        return super().restart_groups(initial)

    def restart_from_initial(self) -> bool:
        self._agree("restart_from_initial")
        return super().restart_from_initial()


class InMemoryCommunicator:
    """The :class:`~lightning_hdet.hdet.execution.comm.Communicator` of one simulated rank (one per group) of a
    :class:`FakeWorld`: a collective offers this rank's tensor at a barrier of its process group's threads and
    combines every member's, in rank order. A process group is a tuple of ranks (``None``: every rank)."""

    _COMBINE = {"sum": lambda t: t.sum(dim=0), "max": lambda t: t.amax(dim=0), "min": lambda t: t.amin(dim=0)}

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world = world
        self.rank = rank

    def world_size(self, group: Any = None) -> int:
        return len(self._ranks(group))

    def all_reduce(self, tensor: Tensor, group: Any = None, op: str = "sum") -> None:
        offered = self._offer(tensor, group, "all_reduce", op)
        tensor.copy_(self._COMBINE[op](torch.stack(offered)))

    def all_reduce_future(self, tensor: Tensor, group: Any = None) -> torch.futures.Future[Tensor]:
        """Summed at once; the future is already done."""
        self.all_reduce(tensor, group)
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_result(tensor)
        return future

    def reduce(self, tensor: Tensor, dst: int = 0, group: Any = None) -> None:
        """The other ranks' ``tensor`` is left as it was."""
        offered = self._offer(tensor, group, "reduce", dst)
        if self.rank == dst:
            tensor.copy_(torch.stack(offered).sum(dim=0))

    def broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> None:
        tensor.copy_(self._offer(tensor, group, "broadcast", src)[src])

    def _ranks(self, group: Any) -> tuple[int, ...]:
        ranks = self.world.ranks if group is None else tuple(group)
        if self.rank not in ranks:
            raise ValueError(f"rank {self.rank} called a collective over group={group!r}, which it is not in "
                             f"(FakeWorld's process groups are tuples of its ranks {self.world.ranks}).")
        return ranks

    def _offer(self, tensor: Tensor, group: Any, *call: Any) -> list[Tensor]:
        ranks = self._ranks(group)
        return self.world.exchange(self.rank, (*call, ranks, tuple(tensor.shape), tensor.dtype), tensor.clone(),
                                   ranks)


class FakeSite:
    """What a merge carries in a :class:`FakeWorld`: group ``group``'s row of ``world.params`` (the group's one
    rank holds it all); a restarted optimizer is counted in ``world.restarts``."""

    def __init__(self, world: FakeWorld, group: int) -> None:
        self.world = world
        self.group = group

    def merge_parts(self) -> list[MergePart]:
        return [MergePart([self.world.params[self.group]], 1.0, None)]

    def iterate_part(self) -> MergePart:
        return MergePart([], 1.0, None)  # no schedule-free optimizer

    def clear_optimizer_state(self) -> None:
        self.world.restarts[self.group] += 1

    def reshard(self) -> None:
        """Nothing is sharded."""


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if len(a) != len(b):
        return False
    return all(torch.equal(x, y) if isinstance(x, Tensor) and isinstance(y, Tensor) else x == y for x, y in zip(a, b))


@dataclass
class FakeModule:
    """What the callback asks of a LightningModule: ``log`` (kept in ``logged``)."""

    logged: dict[str, float] = field(default_factory=dict)
    automatic_optimization: bool = True

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged[name] = float(value)


@dataclass
class FakeTrainer:
    """What the callback asks of a Trainer, for one group's rank (``strategy`` is its :class:`FakeExecutor`)."""

    strategy: FakeExecutor
    max_steps: int = -1
    global_step: int = 0
    log_every_n_steps: int = 50
    accumulate_grad_batches: int = 1
    optimizers: list[Any] = field(default_factory=list)
    ckpt_path: Optional[str] = None
    sanity_checking: bool = False
    estimated_stepping_batches: float = math.inf
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    loggers: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)  # the others a Trainer would hold (e.g. a ModelCheckpoint)
    # The training data per epoch and the validation's cadence (``monitor="auto"``): an unbounded stream by default.
    num_training_batches: float = math.inf
    val_check_batch: Optional[float] = None
    check_val_every_n_epoch: Optional[int] = None
    limit_val_batches: float = 1.0

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.group_index == 0

    @property
    def global_rank(self) -> int:
        return self.strategy.group_index
