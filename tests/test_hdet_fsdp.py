"""HDETFSDPStrategy ("hdet_fsdp"): HDET groups as FSDP2 shard groups, 4 CPU processes (2 groups x 2 shards, gloo)
under Lightning's subprocess launcher (see tests/scripts/hdet_fsdp_run.py)."""

from __future__ import annotations

import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_hdet import HDETFSDPStrategy
from lightning_hdet.hdet.execution.comm import GroupComm
from lightning_hdet.hdet.execution.merge import Merger
from lightning_hdet.hdet.fsdp.ensemble import ShardSite, ShardedEnsembleOps
from lightning_hdet.hdet.layout import GroupLayout
from lightning_hdet.testing import FakeWorld
from tests.helpers import Regression
from tests.scripts.hdet_fsdp_run import MLP, STEPS_PER_EPOCH, scenario_dir

pytestmark = pytest.mark.timeout(600)
SCRIPT = Path(__file__).parent / "scripts" / "hdet_fsdp_run.py"


# The scenarios the four end-to-end tests below assert on (sync:shard_where:resume[:extra], see the script).
VALIDATE, CONFIGURE_MODEL = "group:strategy:resume:validate", "group>global:configure_model:no-resume"
NAN, SCHEDULE_FREE = "group:strategy:no-resume:nan", "group:strategy:no-resume:schedulefree"
MONITOR = "group:strategy:no-resume:monitor"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of the script for all four scenarios, one after the other in the same 4 processes (each with
    its own strategy and seed; starting 4 interpreters was most of each test's time)."""
    out = tmp_path_factory.mktemp("hdet_fsdp")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    for name in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK"):
        env.pop(name, None)  # a fresh rendezvous, as conftest gives each test
    args = [sys.executable, str(SCRIPT), str(out), VALIDATE, CONFIGURE_MODEL, NAN, SCHEDULE_FREE, MONITOR]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _run(launched: Path, scenario: str) -> tuple[Path, list[dict]]:
    """A scenario's folder and its 4 ranks' records."""
    out = scenario_dir(launched, scenario)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def _check_training(ranks: list[dict]) -> None:
    """Shards are halves, LRs follow the multipliers, losses are finite, each merge lands on the groups' mean."""
    first = [r["first"] for r in ranks]
    assert [f["group_index"] for f in first] == [0, 0, 1, 1]
    assert all(2 * f["local_numel"] == f["numel"] for f in first)
    assert [f["lrs"][0] for f in first] == pytest.approx([0.01, 0.01, 0.03, 0.03])  # multipliers [1, 3]
    assert all(torch.isfinite(torch.tensor(list(f["losses"].values()))).all() for f in first)
    for step in (2, 4):  # votes (every 2 steps): every group ends at the mean of the groups' pre-merge parameters
        group0, group1 = first[0]["before"][step], first[2]["before"][step]
        assert not torch.allclose(group0, group1)
        for f in first:
            torch.testing.assert_close(f["after"][step], (group0 + group1) / 2)


def test_group_sync_merges_checkpoints_consolidates_and_resumes_exactly(launched: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating at each epoch's end too: the validated model is the merged one a checkpoint holds, and each group's
    own state comes back after it (the exact resume and merges below would not hold otherwise)."""
    out, ranks = _run(launched, VALIDATE)
    _check_training(ranks)
    first, resumed = [r["first"] for r in ranks], [r["resumed"] for r in ranks]
    # exact resume from the step-3 checkpoint: each group restarts from its own parameters and optimizer state
    for f, r in zip(first, resumed):
        assert torch.equal(r["start"]["before"], f["before"][STEPS_PER_EPOCH])
        assert r["losses"] == {s: f["losses"][s] for s in r["losses"]}
        torch.testing.assert_close(r["final"], f["final"])
    # Lightning's own consolidation turns the folder into a file whose state_dict is the merged model (its command
    # line, `python -m lightning.pytorch.utilities.consolidate_checkpoint FOLDER`, run in this process: a fresh
    # interpreter spent ~4 s of CPU importing Lightning)
    folder = out / "ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    monkeypatch.setattr(sys, "argv", ["consolidate_checkpoint", str(folder)])
    runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__", alter_sys=True)
    checkpoint = torch.load(f"{folder}.consolidated", weights_only=True)
    plain = MLP()
    plain.load_state_dict(checkpoint["state_dict"])
    merged = (first[0]["before"][STEPS_PER_EPOCH] + first[2]["before"][STEPS_PER_EPOCH]) / 2
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]), merged)
    # validation saw that merged model on every rank, and logged the consolidated file's own validation loss
    for f in first:
        torch.testing.assert_close(f["validated"][STEPS_PER_EPOCH], merged)
    x, y = Regression(n=16, seed=1).x, Regression(n=16, seed=1).y
    with torch.no_grad():
        own_loss = float(torch.nn.functional.mse_loss(plain.net(x)[:, :1], y))
    assert first[0]["val_loss"][STEPS_PER_EPOCH] == pytest.approx(own_loss, rel=1e-5)


def test_global_sync_with_sharding_in_configure_model(launched: Path) -> None:
    """Built with ``"group"`` and switched to ``"global"`` once sharded (``set_gradient_sync``, as ``search_steps``
    does): from the first step every group's gradient is the mean over the groups."""
    _, ranks = _run(launched, CONFIGURE_MODEL)
    _check_training(ranks)
    first = [r["first"] for r in ranks]
    # one shared gradient: from the same start, group 1 (3x the LR) moved 3x as far in its first step
    start = first[0]["start"]["before"]
    torch.testing.assert_close(first[2]["before"][1] - start, 3 * (first[0]["before"][1] - start), rtol=1e-4,
                               atol=1e-6)


def test_safety_net_rescues_a_sharded_group_whose_loss_goes_nan(launched: Path) -> None:
    """Group 1 (both its shards) has a NaN loss at step 3: the step is flagged on its ranks only, the vote at
    step 4 rescues it (it takes group 0's parameters, its LR is halved) and every rank ends finite and equal."""
    first = [r["first"] for r in _run(launched, NAN)[1]]
    assert [f["skipped"] for f in first] == [0, 0, 1, 1]
    assert all(math.isnan(f["losses"][4]) == (f["group_index"] == 1) for f in first)  # step 3's loss, logged at 4
    for f in first:
        assert f["lrs"][4] == pytest.approx(0.01 if f["group_index"] == 0 else 0.03 * 0.5)  # meta_lr=0: only the cut
        assert all(torch.isfinite(params).all() for params in f["before"].values())  # no NaN reached a parameter
        torch.testing.assert_close(f["after"][4], first[0]["before"][4])  # the target: the healthy group alone
    assert all(torch.isfinite(f["final"]).all() and torch.equal(f["final"], first[0]["final"]) for f in first)


def test_schedule_free_shards_blend_their_base_iterate_with_the_parameters(launched: Path) -> None:
    """Schedule-free AdamW on shards: each vote (mean blend) gives every group the mean of the groups' ``z`` (a
    DTensor in the optimizer state) as of their parameters, so the average it evaluates is blended too."""
    _, ranks = _run(launched, SCHEDULE_FREE)
    _check_training(ranks)
    first = [r["first"] for r in ranks]
    for step in (2, 4):
        group0, group1 = first[0]["before_z"][step], first[2]["before_z"][step]
        assert not torch.allclose(group0, group1)
        for f in first:
            torch.testing.assert_close(f["after_z"][step], (group0 + group1) / 2)


def test_a_sync_dist_metric_under_monitor_is_each_sharded_groups_own(launched: Path) -> None:
    """``monitor="val_loss"`` logged with ``sync_dist=True``: every rank sees its group's mean of its two shards'
    ranks' own losses, not the job's, and each vote (due at 2 and 4, at the epoch-end validations 3 and 6) reads it."""
    _, ranks = _run(launched, MONITOR)
    first = [r["first"] for r in ranks]
    history = first[0]["history"]
    assert sorted({h["step"] for h in history}) == [3, 6]
    for step in (3, 6):
        own = [f["own_val"][step] for f in first]
        groups = [(own[0] + own[1]) / 2, (own[2] + own[3]) / 2]
        assert [f["val_loss"][step] for f in first] == pytest.approx([groups[0]] * 2 + [groups[1]] * 2, rel=1e-6)
        assert [h["loss"] for h in history if h["step"] == step] == pytest.approx(groups, rel=1e-6)
        assert groups[0] != pytest.approx(groups[1], rel=1e-3)


@pytest.mark.parametrize(("kwargs", "devices", "match"), [
    ({"num_groups": 3}, 4, "does not divide the world size 4"),
    ({}, 1, "more than one process"),
    ({"mesh": None}, 4, "unsupported argument `mesh`=None.*builds the device mesh itself"),
    ({"auto_wrap_policy": 3}, 4, "`auto_wrap_policy` must be None, a set of torch.nn.Module classes"),
    ({"gradient_sync": "all"}, 4, "`gradient_sync` must be one of"),
])
def test_bad_arguments_fail_before_any_process_group(kwargs: dict, devices: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Trainer(strategy=HDETFSDPStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)
    assert not torch.distributed.is_initialized()


# The gradient mean hook (GroupGradientMean) over several groups: tests/test_fake_collectives.py.


class _ShardRank(ShardedEnsembleOps):
    """ShardedEnsembleOps of one rank of a FakeWorld (rank g is group g's one shard): what its merger reads."""

    def __init__(self, module: torch.nn.Module, comm, rank: int, num_groups: int) -> None:
        self.lightning_module, self.across_groups = module, None  # every rank holds shard 0 of its group
        self.layout, self.group_index, self.root_device = GroupLayout(num_groups, num_groups), rank, torch.device("cpu")
        self.optimizers = []
        self.merger = Merger(ShardSite(self), GroupComm(self, comm))


def _weighted_linear(scale: float) -> torch.nn.Linear:
    """Weights scale x [2, 4], bias scale x 6 and a float64 buffer scale x 8: shards, then buffers, as a merge
    carries them."""
    module = torch.nn.Linear(2, 1)
    module.register_buffer("stat", torch.tensor([8.0 * scale], dtype=torch.float64))
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[2.0, 4.0]]) * scale)
        module.bias.fill_(6.0 * scale)
    return module


def _values(module: torch.nn.Linear) -> list[float]:
    return [*module.weight.flatten().tolist(), module.bias.item(), module.stat.item()]


def _on_two_groups(body, scales=(1.0, 2.0)):
    """``body(ops, module)`` on each of two groups' one rank (a FakeWorld), group g's model ``_weighted_linear(
    scales[g])``; the results in group order."""
    world = FakeWorld([0.0], [1.0, 1.0])

    def run(executor):
        module = _weighted_linear(scales[executor.group_index])
        return body(_ShardRank(module, executor.hdet.groups.comm, executor.group_index, 2), module)

    return world.run(run)


def test_sharded_merge_writes_the_target_and_moves_by_strength() -> None:
    """Shards and float buffers go through the shared bucketed merge; the target becomes the restore point."""

    def merge(ops, module):
        ops.merger.merge([0.5, 0.5], [0.25, 0.25], [False, False])
        moved, point = _values(module), ops.merger.restore_point
        ops.merger.restore()
        return moved, point.dtype, point.tolist(), _values(module)

    # target = 0.5 theta_0 + 0.5 theta_1 = 1.5 x [2, 4, 6, 8]; each group moves (1 - 0.25) theta_g + 0.25 target
    target = [3.0, 6.0, 9.0, 12.0]
    moved = [[0.75 * v + 0.25 * t for v, t in zip([2.0, 4.0, 6.0, 8.0], target)],
             [0.75 * v + 0.25 * t for v, t in zip([4.0, 8.0, 12.0, 16.0], target)]]
    assert _on_two_groups(merge) == [(moved[g], torch.float64, target, target) for g in range(2)]


def test_sharded_groups_validate_the_healthy_mean_and_get_their_own_state_back() -> None:
    """Validation's swap (hdet/execution/validation.py) on shards and buffers: swapped in, every group holds the mean of
    the groups whose shards are finite (group 1's NaN weight leaves it out); swapped out, exactly its own values."""

    def validate(ops, module):
        ops.merger.validate_merged(True)
        ops.merger.validate_merged(True)  # idempotent: the own state kept is not overwritten by the merged one
        merged, point = _values(module), ops.merger.restore_point
        ops.merger.validate_merged(False)
        return merged, point, _values(module)

    both = _on_two_groups(validate)
    assert both == [([3.0, 6.0, 9.0, 12.0], None, [2.0, 4.0, 6.0, 8.0]),
                    ([3.0, 6.0, 9.0, 12.0], None, [4.0, 8.0, 12.0, 16.0])]  # keep=False: no restore point
    healthy = _on_two_groups(validate, scales=(1.0, math.nan))
    assert [merged for merged, _, _ in healthy] == [[2.0, 4.0, 6.0, 8.0]] * 2
    assert healthy[0][2] == [2.0, 4.0, 6.0, 8.0] and all(math.isnan(v) for v in healthy[1][2])
