"""Every HDET collective through the injected communicator, in one process: the guard's gradient mean and step
flag, the merged model of a checkpoint (both strategies), the sharded strategy's start and gradient mean, over the
ranks of a :class:`~lightning_hdet.testing.FakeWorld` (one thread per rank), against values computed by hand. The
same code over ``torch.distributed`` runs end to end in test_reliability.py, test_strategy.py and test_hdet_fsdp.py."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet import HDETFSDPStrategy, HDETStrategy
from lightning_hdet.hdet.execution.comm import ProcessGroupCommunicator
from lightning_hdet.hdet.execution.guard import FiniteGuard, NonFiniteSteps
from lightning_hdet.hdet.fsdp.checkpoint import healthy_merge
from lightning_hdet.hdet.fsdp.shards import GroupGradientMean, broadcast_from_first_group
from lightning_hdet.hdet.lightning.ensemble import merged_on_rank_zero
from lightning_hdet.testing import FakeWorld

pytestmark = pytest.mark.timeout(60)
NAN = math.nan


def _world(ranks: int) -> FakeWorld:
    """``ranks`` simulated ranks (a FakeWorld's groups, one rank each), for their communicators."""
    return FakeWorld([0.0], [1.0] * ranks)


def _on_every_rank(world: FakeWorld, body):
    """``body(comm, rank)`` on every rank at once; the results in rank order."""
    return world.run(lambda executor: body(executor.hdet.groups.comm, executor.group_index))


# 2 groups x 2 shards: rank r holds shard r % 2 of group r // 2.
def _shard_group(rank: int) -> tuple[int, int]:
    return (rank - rank % 2, rank - rank % 2 + 1)


def _across_groups(rank: int) -> tuple[int, int]:
    return (rank % 2, rank % 2 + 2)


class _Bucket:
    """What DDP hands a communication hook: a flat gradient buffer."""

    def __init__(self, values: list[float]) -> None:
        self._buffer = torch.tensor(values)

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_the_guard_hook_averages_the_finite_buckets_and_flags_only_the_rank_whose_bucket_is_not() -> None:
    buckets = [[1.0, 2.0], [NAN, 4.0], [3.0, 6.0]]

    def hook(comm, rank):
        guard = FiniteGuard(None, 3, torch.device("cpu"), comm)
        mean = FiniteGuard.hook(guard, _Bucket(buckets[rank])).wait()
        return mean.tolist(), bool(guard.flag)

    results = _on_every_rank(_world(3), hook)
    for mean, _ in results:  # rank 1's bucket leaves as zeros: (1 + 0 + 3) / 3, (2 + 0 + 6) / 3
        assert mean == pytest.approx([4 / 3, 8 / 3])
    assert [flag for _, flag in results] == [False, True, False]


def test_a_non_finite_loss_is_skipped_by_its_whole_group_and_only_by_it() -> None:
    """The exact skip's flag agrees within the group (2 groups of 3 ranks: a max over its ranks, so two
    non-finite losses still flag one step), not beyond it."""
    losses = [1.0, NAN, NAN, 2.0, 3.0, 4.0]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def step(comm, rank):
        steps = NonFiniteSteps(torch.device("cpu"), comm)
        group = (0, 1, 2) if rank < 3 else (3, 4, 5)
        checked = steps.wrap(lambda: torch.tensor(losses[rank]), optimizer, None, False, group, 3, True)
        checked()
        checked()
        return float(steps.flag), steps.total()

    assert _on_every_rank(_world(6), step) == [(1.0, 2)] * 3 + [(0.0, 0)] * 3


def test_the_checkpoint_of_full_replicas_is_the_mean_of_the_finite_groups_on_rank_zero_only() -> None:
    def merged(comm, rank):
        weight = torch.tensor([rank + 1.0, 2.0 * (rank + 1)])
        stat = torch.tensor([NAN if rank == 1 else 10.0 * (rank + 1)], dtype=torch.float64)
        groups = world.parts[rank].groups
        return merged_on_rank_zero(groups, [weight, stat], rank == 0)

    world = _world(3)
    results = _on_every_rank(world, merged)
    weight, stat = results[0]  # groups 0 and 2: ([1, 2] + [3, 6]) / 2, (10 + 30) / 2
    assert weight.tolist() == [2.0, 4.0] and stat.dtype == torch.float64 and stat.tolist() == [20.0]
    assert results[1:] == [None, None]


def test_the_sharded_checkpoint_averages_the_groups_whose_every_shard_is_finite() -> None:
    """Rank 3 (group 1's second shard) is not finite: group 1 is left out on both of its ranks, even where its
    entries are finite (rank 2) or not (rank 3); integer entries stay as they are."""

    def merged(comm, rank, bad):
        shards = [torch.tensor([NAN if rank in bad else 1.0])]
        state = {"stat": torch.tensor([NAN if rank in bad else rank + 1.0]), "steps": torch.tensor(rank)}
        out = healthy_merge(state, shards, 2, (_across_groups(rank), _shard_group(rank), 2), comm)
        return out["stat"].item(), out["steps"].item()

    world = _world(4)
    # healthy: group 0 alone, its ranks' (1 + 2) / 2 (each rank's buffer, over the group's 2 ranks)
    assert _on_every_rank(world, lambda c, r: merged(c, r, {3})) == [(1.5, 0), (1.5, 1), (1.5, 2), (1.5, 3)]
    # all healthy: (1 + 2 + 3 + 4) / 4
    assert _on_every_rank(world, lambda c, r: merged(c, r, set())) == [(2.5, 0), (2.5, 1), (2.5, 2), (2.5, 3)]


def test_sharded_groups_start_from_group_zeros_shards_and_rank_zeros_buffers() -> None:
    def start(comm, rank):
        module = torch.nn.Linear(1, 1)
        module.register_buffer("stat", torch.tensor([10.0 * rank]))
        with torch.no_grad():
            module.weight.fill_(rank)
            module.bias.fill_(-rank)
        broadcast_from_first_group(module, _across_groups(rank), comm)
        return module.weight.item(), module.bias.item(), module.stat.item()

    # shard 0 (ranks 0, 2) from rank 0, shard 1 (ranks 1, 3) from rank 1; buffers from rank 0
    assert _on_every_rank(_world(4), start) == [(0.0, 0.0, 0.0), (1.0, -1.0, 0.0), (0.0, 0.0, 0.0),
                                                (1.0, -1.0, 0.0)]


def test_the_shared_gradient_of_sharded_groups_leaves_a_non_finite_shard_at_home() -> None:
    shards = [[4.0, 8.0], [2.0, NAN]]

    def mean(comm, rank):
        hook = GroupGradientMean(None, 2, torch.device("cpu"), True, comm)
        shard = torch.tensor(shards[rank])
        hook(shard)
        flag = bool(hook.flag)
        hook.reset()
        return shard.tolist(), flag, bool(hook.flag)

    # rank 1's shard is zeroed before it leaves: [4, 8] / 2 + 0
    assert _on_every_rank(_world(2), mean) == [([2.0, 4.0], False, False), ([2.0, 4.0], True, False)]


def test_the_fake_refuses_a_collective_over_a_group_without_the_rank() -> None:
    with pytest.raises(ValueError, match="not in"):
        _on_every_rank(_world(2), lambda comm, rank: comm.all_reduce(torch.zeros(1), (0,)))


@pytest.mark.parametrize("strategy", [HDETStrategy, HDETFSDPStrategy])
def test_the_strategies_take_their_communicator(strategy) -> None:
    comm = _world(1).parts[0].groups.comm
    given, default = strategy(communicator=comm), strategy()
    assert given.communicator is comm and given.hdet.guard.comm is comm
    assert isinstance(default.communicator, ProcessGroupCommunicator)
