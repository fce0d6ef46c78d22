"""Pushes checked before they are applied (issue #29), in one process: the rule by hand, the outer state, and a
server with workers over the in-memory transport of test_async_exchange. Values are computed by hand in the
comments."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet import AsyncLocalSGDStrategy
from lightning_hdet.asynchronous.outer.checks import DISCARDED_BY_WORKER, PushCheck, buffers_problem
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, Nesterov
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push
from tests.test_async_exchange import CPU, _round, _start

RANGES = [(0, 2), (2, 3)]  # a 3-value model in two fragments


def _outer(mode: str = "async", budget: int | None = 100, **kwargs):
    """Plain SGD outer step, lr 1 (theta <- theta - g; sync: theta <- theta - mean g), two workers."""
    settings = OuterSettings(mode=mode, local_steps=4, outer=Nesterov(lr=1.0, momentum=0.0),
                             **kwargs)
    return settings.build(torch.zeros(3), torch.zeros(1), workers=2, budget=budget, ranges=RANGES)


def _push(worker: int, g, steps: int = 4, buffers=None, kind: Kind = Kind.PUSH) -> Push:
    gradient = g if isinstance(g, torch.Tensor) or g is None else torch.tensor(g)
    return Push(worker, kind, steps, 1.0, 0.0, gradient,
                buffers=torch.tensor([1.0]) if buffers is None else buffers)


# ------------------------------------------------------------------------------------------------- the rule
def test_the_norm_limit_is_a_multiple_of_the_larger_median_once_there_is_history() -> None:
    check = PushCheck(max_norm_ratio=10.0, min_history=4)
    for norm in (1.0, 2.0, 3.0):
        check.accepted(0, norm)
    assert check.limit(0) == math.inf  # 3 accepted < min_history
    check.accepted(1, 4.0)
    # everyone: median(1, 2, 3, 4) = 2.5; worker 0's own: median(1, 2, 3) = 2; worker 1's: 4
    assert check.limit(0) == 25.0 and check.limit(1) == 40.0 and check.limit(7) == 25.0
    zero = PushCheck(min_history=1)
    zero.accepted(0, 0.0)
    assert zero.limit(0) == math.inf  # never against a median of 0


def test_with_stagger_each_part_and_the_whole_model_have_their_own_medians() -> None:
    """F = 4 parts of one value each. Parts 0-2 pushed norms 1, part 3 (a larger part) norms 3, and goodbyes (the
    whole model) norms 2. One mixed median would be 1 (12 ones, 4 threes, 4 twos): limit 10 for everything, refusing
    an honest part-3 push of 12. Per kind: parts 0-2 limit 10, part 3 limit 30, the whole model 20."""
    check = PushCheck(max_norm_ratio=10.0, min_history=4)
    for worker in (0, 1):
        for _ in range(2):
            for part, norm in ((0, 1.0), (1, 1.0), (2, 1.0), (3, 3.0), (-1, 2.0)):
                check.accepted(worker, norm, part)
    assert [check.limit(0, part) for part in (0, 1, 2, 3, -1)] == [10.0, 10.0, 10.0, 30.0, 20.0]
    assert check.limit(7, 3) == 30.0 and check.limit(7) == 20.0  # a worker without history: everyone's median
    whole = [(0, 1), (1, 2), (2, 3), (3, 4)]
    honest_bye = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1.0])]
    assert check.inspect(0, honest_bye, whole, None)[0] is None  # norm 2, limit 20
    assert check.inspect(0, [torch.tensor([12.0])], [(3, 4)], None, part=3)[0] is None  # limit 30
    # 11: above part 1's limit 10, though below 10 x the whole model's median (20)
    assert check.inspect(0, [torch.tensor([11.0])], [(1, 2)], None, part=1)[0] == (
        "norm 11 above 10 x the recent median of part 1's pushes (limit 10)")
    fresh = PushCheck(min_history=1)
    fresh.accepted(0, 1.0, part=0)
    assert fresh.limit(0, part=1) == math.inf  # no history of that kind yet
    assert fresh.limit(0) == 10.0  # the whole model: against its parts' (below)


def test_a_staggered_goodbye_without_history_of_its_own_is_judged_against_its_parts() -> None:
    """F = 2 parts with medians 3 and 4 (four pushes each, none of the whole model): the whole model's reference is
    sqrt(3^2 + 4^2) = 5, so a goodbye of norm 50 passes and one of 51 is refused; with only part 0's history the
    reference is 3 (limit 30); a part without history stays unchecked."""
    check = PushCheck()
    for _ in range(4):
        check.accepted(0, 3.0, part=0)
    assert check.limit(0) == 30.0 and check.limit(0, part=1) == math.inf
    for _ in range(4):
        check.accepted(1, 4.0, part=1)
    assert check.limit(0) == 50.0
    assert check.inspect(0, [torch.tensor([30.0, 40.0])], [(0, 2)], None)[0] is None
    assert check.inspect(0, [torch.tensor([30.0, 40.6])], [(0, 2)], None)[0] == (
        "norm 50.48 above 10 x the recent median (limit 50)")


def test_inspect_reads_every_fragment_and_names_the_first_problem() -> None:
    check = PushCheck()
    ok = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    assert check.inspect(0, ok, RANGES, None) == (None, ok, 5.0)  # sqrt(9 + 16)
    consumed = []

    def stream(parts):
        for p in parts:
            consumed.append(p)
            yield p

    cases = {
        "non-finite values in fragment 1": [torch.tensor([1.0, 1.0]), torch.tensor([math.nan])],
        "non-finite values in fragment 0": [torch.tensor([math.inf, 1.0]), torch.tensor([1.0])],
        "fragment 0 has shape (3,), expected (2,)": [torch.zeros(3), torch.zeros(1)],
        "fragment 1 is torch.float64, expected torch.float32": [torch.zeros(2), torch.zeros(1, dtype=torch.float64)],
        "1 fragments, the layout has 2": [torch.zeros(2)],
        "more fragments than the layout's 2": [torch.zeros(2), torch.zeros(1), torch.zeros(1)],
    }
    for reason, parts in cases.items():
        consumed.clear()
        assert check.inspect(0, stream(parts), RANGES, None)[0] == reason
        assert len(consumed) == len(parts)  # a stream is always read to its end
    for n in (1.0, 1.0, 1.0, 1.0):
        check.accepted(0, n)
    assert check.inspect(0, [torch.tensor([30.0, 0.0]), torch.tensor([40.0])], RANGES, None)[0] == (
        "norm 50 above 10 x the recent median (limit 10)")


def test_a_staged_fragment_is_a_copy_in_the_staging_buffer() -> None:
    stage = torch.zeros(3)
    reused = torch.tensor([1.0, 2.0])
    _, kept, _ = PushCheck().inspect(0, [reused, torch.tensor([3.0])], RANGES, stage)
    reused.fill_(9.0)  # the stream's buffer is overwritten by its next fragment
    assert [k.tolist() for k in kept] == [[1.0, 2.0], [3.0]] and stage.tolist() == [1.0, 2.0, 3.0]


def test_buffer_problems() -> None:
    assert buffers_problem(None, 1) is None and buffers_problem(torch.ones(1), 1) is None
    assert buffers_problem(torch.tensor([math.nan]), 1) == "non-finite buffer values"
    assert buffers_problem(torch.ones(2), 1) == "buffers are torch.float32[2], expected torch.float32[1]"


def test_push_checks_are_an_object_checked_on_creation_and_the_old_arguments_name_it() -> None:
    with pytest.raises(ValueError, match="`max_norm_ratio` must be a finite number > 1, got 1.0"):
        PushCheck(max_norm_ratio=1.0)
    with pytest.raises(ValueError, match="`max_rejections` must be a positive integer"):
        PushCheck(max_rejections=0)
    with pytest.raises(ValueError, match=r"`check_pushes` must be True, False or a PushCheck"):
        OuterSettings(check_pushes="yes")
    with pytest.raises(ValueError, match=r"no longer takes `max_rejections`=5.* check_pushes=PushCheck\(max_rejections"):
        AsyncLocalSGDStrategy(check_pushes=False, max_rejections=5)
    mine = PushCheck(max_norm_ratio=5.0, max_rejections=2)
    settings = OuterSettings(check_pushes=mine)
    assert settings.check_pushes is mine and OuterSettings(check_pushes=True).check_pushes == PushCheck()
    assert OuterSettings(check_pushes=False).check_pushes is None
    outer = settings.build(torch.zeros(1), torch.zeros(0), workers=2, budget=None)
    assert outer.check == mine and outer.check is not mine and outer.max_rejections == 2  # a fresh copy per run


# ------------------------------------------------------------------------------------------ the outer state
BAD = {
    "nan": [1.0, math.nan, 1.0],
    "inf": [1.0, 1.0, -math.inf],
    "shape": torch.ones(4),
    "dtype": torch.ones(3, dtype=torch.float64),
    "huge": [1e6, 0.0, 0.0],
    "missing": None,  # steps, but no pseudo-gradient
}


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_push_is_rejected_whole_and_its_budget_released(mode: str, bad: str) -> None:
    """Four healthy rounds of both workers (g = [0.5, 0, 0] each, 4 steps) build the history (norm 0.5), then
    worker 1's bad push: nothing of it reaches the global model or its buffers, its steps do not count, its
    in-flight share is free, the rejection is counted and its next reply carries it."""
    outer = _outer(mode)
    outer.process([_push(0, None, 0, kind=Kind.HELLO), _push(1, None, 0, kind=Kind.HELLO)])
    for _ in range(4):
        outer.process([_push(0, [0.5, 0.0, 0.0]), _push(1, [0.5, 0.0, 0.0])])
    # async: 8 pushes of -0.5 -> -4; sync: 4 means of 0.5 -> -2
    before = outer.params.clone()
    assert before.tolist() == ([-4.0, 0.0, 0.0] if mode == "async" else [-2.0, 0.0, 0.0])
    updates = outer.outer_updates
    replies = outer.process([_push(0, [0.5, 0.0, 0.0], buffers=torch.tensor([2.0])),
                             _push(1, BAD[bad], buffers=torch.tensor([100.0]))])
    # only worker 0's push: async theta[0] - 0.5; sync: mean over the one applied push, also - 0.5
    assert outer.params.tolist() == [before[0].item() - 0.5, 0.0, 0.0]
    # the buffers: the mean of worker 0's new [2] and worker 1's last applied [1]
    assert outer.outer_updates == updates + 1 and outer.buffers.tolist() == [1.5]
    stats = outer.workers[1]
    assert (stats.rejected, stats.rejected_steps, stats.rejected_streak, stats.steps) == (1, 4, 1, 16)
    assert outer.steps_done == 36 and outer.rejection_streak(1) == 1 and outer.rejection_streak(0) == 0
    metrics = outer.metrics()
    assert replies[1] == 4 and metrics["async/worker1/rejected"] == 1
    # counts are logged as integers, rates and seconds as floats
    assert all(type(metrics[f"async/worker1/{k}"]) is int
               for k in ("local_steps", "staleness", "rounds", "push_bytes", "pull_bytes", "rejected"))
    assert type(metrics["async/outer_updates"]) is int and type(metrics["async/worker1/steps_per_s"]) is float


def test_max_rejections_in_a_row_stop_a_worker_and_an_applied_push_resets_the_count() -> None:
    outer = _outer(check_pushes=PushCheck(max_rejections=2))
    outer.process([_push(1, None, 0, kind=Kind.HELLO)])
    assert outer.process([_push(1, [math.nan] * 3)]) == {1: 4}
    assert outer.process([_push(1, [0.1, 0.0, 0.0])]) == {1: 4} and outer.rejection_streak(1) == 0
    outer.process([_push(1, [math.nan] * 3)])
    assert outer.process([_push(1, None, steps=0)]) == {1: 0}  # a discarded round counts too: 2 in a row, stop
    assert outer.excluded(1) and outer.workers[1].rejected == 3 and outer.steps_done == 4


def test_a_round_the_worker_discarded_counts_as_rejected_even_unchecked() -> None:
    outer = _outer(check_pushes=False)
    outer.process([_push(0, None, 0, kind=Kind.HELLO)])
    outer.process([_push(0, None, steps=0)])  # PUSH without steps: the worker discarded its round
    assert outer.workers[0].rejected == 1 and outer.steps_done == 0 and outer.params.tolist() == [0.0] * 3


def test_delayed_nesterov_counts_only_the_applied_pushes() -> None:
    """N = 2, momentum 0.5, lr 1: push 1 (g = 1) moves theta by -g/2; a rejected push is not the second one;
    the next healthy push (g = 1) completes the buffer: m = 1, theta -= 0.5 * m + g / 2 -> -1.5."""
    settings = OuterSettings(local_steps=4, outer=DelayedNesterov(lr=1.0, momentum=0.5, buffer_size=2))
    outer = settings.build(torch.zeros(1), torch.zeros(0), workers=2, budget=None, ranges=[(0, 1)])
    for push in ([1.0], [math.nan], [1.0]):
        outer.process([Push(0, Kind.PUSH, 4, 1.0, 0.0, torch.tensor(push))])
    assert outer.params.tolist() == [-1.5] and outer.outer_updates == 2


def test_the_outer_state_checks_a_staggered_push_against_its_own_part() -> None:
    """F = 2 parts of two 1-value fragments each, DiLoCo, outer lr 1. Four rounds of both parts (the first worker's
    norm 1 in part 0, 10 in part 1) build each part's history: limits 10 and 100 (a mixed median, 5.5, would give
    55 to both). Then a part-0 push of norm 20 is rejected and a part-1 push of norm 60 applied."""
    layout = Fragments([torch.Size([4])], parts=2)
    assert layout.parts == [range(2), range(2, 4)]
    outer = OuterSettings(mode="sync", local_steps=4, stagger=2, outer=DelayedNesterov(lr=1.0, momentum=0.0)).build(
        torch.zeros(4), torch.zeros(0), workers=1, budget=None, ranges=layout.ranges, parts=layout.parts)
    outer.process([Push(0, Kind.HELLO, 0, 1.0, 0.0)])

    def push(part: int) -> Push:
        return Push(0, Kind.PUSH, 2, 1.0, 0.0, part=part)

    def fragments(norm: float) -> list[torch.Tensor]:
        return [torch.tensor([norm]), torch.tensor([0.0])]

    for _ in range(4):
        for part, norm in ((0, 1.0), (1, 10.0)):
            pushed = push(part)
            outer.receive(pushed, fragments(norm), stable=True)
            outer.close([pushed])
    assert outer.params.tolist() == [-4.0, 0.0, -40.0, 0.0] and outer.workers[0].rejected == 0
    rejected, applied = push(0), push(1)
    outer.receive(rejected, fragments(20.0), stable=True)
    outer.receive(applied, fragments(60.0), stable=True)
    outer.close([rejected, applied])
    assert rejected.rejected == "norm 20 above 10 x the recent median of part 0's pushes (limit 10)"
    assert applied.rejected is None and outer.params.tolist() == [-4.0, 0.0, -100.0, 0.0]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_healthy_run_is_bit_identical_with_the_checks_on_and_off(mode: str) -> None:
    """Delayed Nesterov / DiLoCo's Nesterov with random pushes of two workers in two fragments."""
    results = []
    for check_pushes in (True, False):
        settings = OuterSettings(mode=mode, local_steps=4, check_pushes=check_pushes)
        outer = settings.build(torch.zeros(3), torch.zeros(1), workers=2, budget=None, ranges=RANGES)
        g = torch.Generator().manual_seed(0)
        for _ in range(12):
            outer.process([_push(w, torch.randn(3, generator=g), buffers=torch.randn(1, generator=g)) for w in (0, 1)])
        results.append((outer.params.clone(), outer.buffers.clone(), outer.outer_updates))
    (p1, b1, u1), (p2, b2, u2) = results
    assert torch.equal(p1, p2) and torch.equal(b1, b2) and u1 == u2 == (24 if mode == "async" else 12)


# ------------------------------------------------------------------------------- server and workers, streamed
def test_a_streamed_push_non_finite_in_its_last_fragment_leaves_no_trace() -> None:
    """Fragments of one value: worker 1's pseudo-gradient is [2, nan] (its w went to [-2, nan] from [0, 0]);
    its first fragment arrives, and is checked, before the second: the global model stays [0, 0], and worker 1
    (which checks nothing itself here) is told of the rejection and clears its optimizer state."""
    layout = Fragments([torch.Size([2])], max_bytes=4)
    settings = OuterSettings(local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    server, network, modules = _start(settings, budget=8, layout=layout)
    optimizer = torch.optim.Adam(modules[1].parameters())
    optimizer.state[modules[1].w]["step"] = torch.tensor(3.0)
    worker = Worker(modules[1], CPU, network.ends[1], layout=layout, optimizer=optimizer, check_self=False)
    worker.exchange(Kind.HELLO)
    _round(worker, modules[1], [-2.0, math.nan], 1.0, 2)
    assert server.outer.params.tolist() == [0.0, 0.0] and server.outer.workers[1].rejected == 1
    assert worker.rejected == 1 and not optimizer.state and worker.lr_factor == 1.0
    assert modules[1].w.tolist() == [0.0, 0.0]  # the global model, pulled
    _round(worker, modules[1], [math.inf, 0.0], 1.0, 2)
    assert worker.rejected == 2 and worker.lr_factor == 0.5  # a second one in a row: half the inner LR
    # rank 0's worker leaves, then worker 1
    Worker(modules[0], CPU, server.local, layout=layout).exchange(Kind.BYE)
    worker.exchange(Kind.BYE)
    server.join()
    assert server.outer.params.tolist() == [0.0, 0.0] and server.outer.steps_done == 0


def test_a_worker_with_non_finite_steps_does_not_push() -> None:
    layout = Fragments([torch.Size([2])])
    settings = OuterSettings(local_steps=2, outer=Nesterov(lr=1.0, momentum=0.0))
    server, network, modules = _start(settings, budget=8, layout=layout)
    sent = []
    end = network.ends[1]
    push = end.push
    end.push = lambda header, messages, buffers, inner: (sent.append(header.steps), push(header, messages, buffers, inner))
    worker = Worker(modules[1], CPU, end, layout=layout)
    worker.exchange(Kind.HELLO)
    _round(worker, modules[1], [1.0, 1.0], math.nan, 2)  # a NaN buffer is enough
    assert sent == [0, 0] and worker.discarded == 1 and worker.rejected == 1
    assert server.outer.workers[1].rejected == 1 and server.outer.workers[1].push_bytes == 0
    assert modules[1].stat.tolist() == [0.0]  # the global buffers, pulled
    Worker(modules[0], CPU, server.local, layout=layout).exchange(Kind.BYE)
    worker.exchange(Kind.BYE)
    server.join()
    assert DISCARDED_BY_WORKER.startswith("discarded by the worker")


def test_the_inner_lr_is_cut_only_inside_the_step_and_restored_for_the_scheduler() -> None:
    """Three rejections in a row: 0.5 ** 2 of each group's LR inside the block, the scheduler's value after."""
    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD([{"params": [module.weight], "lr": 0.1}, {"params": [module.bias], "lr": 0.3}])
    worker = Worker(module, CPU, None, optimizer=optimizer)  # type: ignore[arg-type]
    worker.rejected = 3
    with worker.inner_lr(optimizer):
        assert [g["lr"] for g in optimizer.param_groups] == [0.025, 0.075]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.3]
    worker.rejected = 0
    with worker.inner_lr(optimizer):
        assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.3]


def test_loop_limits_lift_and_give_back_once_and_need_no_trainer_when_nothing_was_lifted():
    """A worker's fit lifts max_steps and gives back max_steps and limit_val_batches on every exit path; before
    set-up (nothing lifted) an exit path must not touch the module's trainer (it has none)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_hdet.asynchronous.lightning.limits import LoopLimits

    limits, module = LoopLimits(), BoringModel()
    limits.restore(module)  # unattached: `module.trainer` would raise
    trainer = Trainer(max_steps=7, limit_val_batches=3, logger=False, enable_checkpointing=False)
    module.trainer = trainer
    limits.lift(trainer)
    trainer.limit_val_batches = 0  # a rank that does not validate
    assert trainer.fit_loop.max_steps == -1
    limits.restore(module)
    assert (trainer.fit_loop.max_steps, trainer.limit_val_batches) == (7, 3)
    trainer.limit_val_batches = 5
    limits.restore(module)  # once: a second exit path leaves the trainer alone
    assert trainer.limit_val_batches == 5
