"""The outer optimizer objects: each one's step by hand in one process, and the same numbers as before they were
objects (bit for bit, recorded from the code they replaced)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from lightning_hdet import AsyncLocalSGDStrategy, DelayedNesterov, Nesterov, SparseLoCo
from lightning_hdet.asynchronous.outer.momentum import stable_outer_lr
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import TopK
from lightning_hdet.asynchronous.wire.messages import Fragments, Kind, Push


def _run(outer, mode: str, workers: int, pushes: list[list[float]], start: list[float]) -> list[float]:
    """One push per entry, worker i % workers, each its own outer update (async) or workers at a time (a
    DiLoCo round)."""
    state = OuterSettings(mode=mode, local_steps=2, outer=outer, check_pushes=False).build(
        torch.tensor(start), torch.zeros(0), workers=workers, budget=None)
    batch = []
    for i, g in enumerate(pushes):
        push = Push(i % workers, Kind.PUSH, 2, 0.0, 0.0, torch.tensor(g))
        if mode == "async":
            state.process([push])
        else:
            batch.append(push)
            if len(batch) == workers:
                state.process(batch)
                batch = []
    return state.params.tolist()


def test_delayed_nesterov_by_hand():
    """lr 1, momentum 0.5, N = 2 (the workers), pushes g = 4, 2, 4: push 1 moves by -g/N = -2; push 2 completes the
    buffer: m = 0 * 0.5 + (4 + 2) / 2 = 3, theta -= 0.5 * 3 + 2 / 2 -> -2 - 2.5 = -4.5; push 3 opens the next cycle:
    -4 / 2 -> -6.5."""
    assert _run(DelayedNesterov(lr=1.0, momentum=0.5), "async", 2, [[4.0], [2.0], [4.0]], [0.0]) == [-6.5]


def test_delayed_nesterov_warm_up_and_restarts_by_hand():
    """DiLoCo, 1 worker, lr 1, momentum 0.5 warmed up over 2 updates, restarted every 2: update 1: beta = 0.25,
    m = 1, step 0.25 + 1 = 1.25; update 2 restarts: m = 0 then 1, beta 0.5: step 0.5 + 1 = 1.5; update 3: beta 0.5,
    m = 0.5 + 1 = 1.5, step 0.75 + 1 = 1.75. theta = -(1.25 + 1.5 + 1.75) = -4.5."""
    outer = DelayedNesterov(lr=1.0, momentum=0.5, warmup=2, restarts=2)
    assert _run(outer, "sync", 1, [[1.0]] * 3, [0.0]) == [-4.5]


def test_nesterov_is_the_published_step_without_warm_up_in_both_modes():
    """lr 0.5, momentum 0.5, g = 2 twice: m = 2, step 0.5 * (0.5 * 2 + 2) = 1.5; m = 3, step 0.5 * (1.5 + 2) = 1.75.
    Async applies every push as its own full step (no delay: N = 1 with 2 workers), DiLoCo steps on the round's mean;
    the same -3.25 either way."""
    outer = Nesterov(lr=0.5, momentum=0.5)
    assert _run(outer, "async", 2, [[2.0], [2.0]], [0.0]) == [-3.25]
    assert _run(outer, "sync", 2, [[1.0], [3.0], [2.0], [2.0]], [0.0]) == [-3.25]


def test_sparseloco_moves_by_lr_times_the_mean_of_the_sparse_pushes():
    """lr 0.5, two workers' topk2 pushes of one kept value of two: [4, 0] and [0, -2]: G = [1, 1] - 0.5 * [2, -1]
    = [0, 1.5], decoded from the forwarded pushes; no momentum, so a second equal round moves as far again."""
    layout = Fragments([torch.Size([2])], TopK(bits=2))
    state = OuterSettings(mode="sync", outer=SparseLoCo(lr=0.5), check_pushes=False).build(
        torch.ones(2), torch.zeros(0), workers=2, budget=None)
    kept = state.step_policy.keeps_messages(layout.codecs, 2)
    for expected in ([0.0, 1.5], [-1.0, 2.0]):
        pushes = [Push(w, Kind.PUSH, 1, 0.0, 0.0) for w in (0, 1)]
        for push, g in zip(pushes, ([4.0, 1.0], [0.5, -2.0])):
            messages = list(kept.keeping(push.worker, layout.encode(torch.tensor(g))))
            state.receive(push, layout.decode(messages, torch.empty(2)))
        state.close(pushes)
        assert state.params.tolist() == expected


# Recorded on 2026-12-06 by running the code these objects replaced (branch layout at a098f7b, and main at 783d514
# with its flat module names: the same values) with the old arguments named in each case's comment: the global
# model after 12 rounds of 3 workers, fixed-seed pushes (see _recorded_run), as float.hex.
RECORDED = {
    "stable_async": ['-0x1.2940280000000p-2', '0x1.88cfd80000000p+0', '-0x1.0542720000000p+2', '0x1.b02db20000000p+0', '0x1.742e260000000p-1', '0x1.220e380000000p+1'],
    "published_async": ['-0x1.4d367c0000000p+2', '0x1.150c500000000p+4', '-0x1.4767360000000p+5', '0x1.a1f9000000000p+3', '0x1.2d6da60000000p+4', '0x1.79cdb20000000p+4'],
    "robust_sync": ['-0x1.657ca20000000p+0', '0x1.506b840000000p+2', '-0x1.c5b7880000000p+3', '0x1.a1b1280000000p+2', '0x1.4855d80000000p+2', '0x1.01f4720000000p+3'],
    "stable_sync": ['-0x1.2940280000000p-2', '0x1.88cfd40000000p+0', '-0x1.0542700000000p+2', '0x1.b02db40000000p+0', '0x1.742e220000000p-1', '0x1.220e3a0000000p+1'],
    "published_sync": ['-0x1.4d367a0000000p+2', '0x1.150c500000000p+4', '-0x1.4767320000000p+5', '0x1.a1f8fa0000000p+3', '0x1.2d6da60000000p+4', '0x1.79cdb20000000p+4'],
    "nesterov_async": ['0x1.6c00a40000000p+3', '0x1.3bd6660000000p+5', '-0x1.89d3980000000p+6', '0x1.66c8c40000000p+5', '0x1.52b2c20000000p+5', '0x1.c70da00000000p+5'],
    "activation_async": ['-0x1.a29e020000000p+0', '0x1.8e031c0000000p+3', '-0x1.47cc080000000p+4', '0x1.59b9aa0000000p+3', '0x1.4030f60000000p+3', '0x1.41a25c0000000p+3'],
}
# The presets' numbers as they were then, written out (a preset's numbers may change: these may not).
STABLE = DelayedNesterov(lr=stable_outer_lr(0.9, 8), momentum=0.9, warmup=16, restarts=8)
ROBUST = DelayedNesterov(lr=0.7, momentum=0.9, warmup=16, restarts=8)
PUBLISHED = DelayedNesterov(lr=0.7, momentum=0.9)
CASES = {
    "stable_async": dict(mode="async", outer=STABLE),  # outer="stable" (the default then)
    "published_async": dict(mode="async", outer=PUBLISHED),  # outer="published"
    "robust_sync": dict(mode="sync", outer=ROBUST),  # outer="robust"
    "stable_sync": dict(mode="sync", outer=STABLE),
    "published_sync": dict(mode="sync", outer=PUBLISHED),
    # outer_lr=0.7, outer_momentum=0.9, delayed_nesterov=False (the "stable" preset's warm-up and restarts kept)
    "nesterov_async": dict(mode="async", outer=DelayedNesterov(lr=0.7, momentum=0.9, warmup=16, restarts=8,
                                                                buffer_size=1)),
    # outer="published", momentum_activation=0.2, buffer_size=3, momentum_warmup=3, momentum_restart=4
    "activation_async": dict(mode="async", outer=DelayedNesterov(lr=0.7, momentum=0.9, buffer_size=3,
                                                                  momentum_activation=0.2, warmup=3, restarts=4)),
}


def _recorded_run(mode: str, outer=None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    state = OuterSettings(mode=mode, local_steps=2, outer=outer, check_pushes=False).build(
        torch.randn(6, generator=generator), torch.zeros(0), workers=3, budget=None)
    for r in range(12):
        pushes = [Push(w, Kind.PUSH, 2, 0.0, 0.0, torch.randn(6, generator=generator) * (1.0 + r % 3)) for w in range(3)]
        for batch in ([[p] for p in pushes] if mode == "async" else [pushes]):
            state.process(batch)
    return state.params


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_objects_compute_what_the_old_arguments_computed_bit_for_bit(case: str) -> None:
    assert [float(v).hex() for v in _recorded_run(**CASES[case])] == RECORDED[case]


def test_sparseloco_computes_what_outer_sparseloco_computed_bit_for_bit() -> None:
    """Recorded as above with outer="sparseloco", outer_lr=0.8: 3 workers, 4 rounds of topk2 pushes of 8,192 values."""
    generator = torch.Generator().manual_seed(99)
    layout = Fragments([torch.Size([8192])], TopK(bits=2))
    state = OuterSettings(mode="sync", outer=SparseLoCo(lr=0.8), check_pushes=False).build(
        torch.randn(8192, generator=generator), torch.zeros(0), workers=3, budget=None)
    kept = state.step_policy.keeps_messages(layout.codecs, 3)
    for _ in range(4):
        pushes = [Push(w, Kind.PUSH, 1, 0.0, 0.0) for w in range(3)]
        for push in pushes:
            messages = list(kept.keeping(push.worker, layout.encode(torch.randn(8192, generator=generator))))
            state.receive(push, layout.decode(messages, torch.empty(8192)))
        state.close(pushes)
    digest = hashlib.sha256(state.params.numpy().tobytes()).hexdigest()
    assert digest == "49c2081f9c1c203547824c6d5e19188efdc528f49fdfd06b32df8a0f08337792"


def test_what_a_user_writes_is_what_runs_and_the_config_shows_every_number() -> None:
    strategy = AsyncLocalSGDStrategy(outer=DelayedNesterov(lr=0.7, momentum=0.9))
    assert strategy.outer_settings.outer == DelayedNesterov(lr=0.7, momentum=0.9, warmup=0, restarts=0)
    config = strategy.config
    assert {k: v for k, v in config.items() if k.startswith("outer")} == {
        "outer": "DelayedNesterov", "outer/lr": 0.7, "outer/momentum": 0.9, "outer/warmup": 0, "outer/restarts": 0,
        "outer/buffer_size": None, "outer/momentum_activation": 0.0, "outer/lookahead": None}
