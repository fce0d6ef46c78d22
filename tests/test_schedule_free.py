"""HDET over schedule-free optimizers: a merge blends their base iterate ``z`` with the parameters, so the average
``x`` they evaluate is the blend of the groups' averages (one rank by hand; four ranks through Lightning)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hdet import HDETCallback, HDETStrategy, Softmax
from lightning_hdet.hdet.execution.merge import iterate_states
from tests.helpers import START, flat_params, load_ranks, trainer_kwargs
from lightning_hdet.testing import FakeWorld
from tests.test_hdet_fsdp import _ShardRank

schedulefree = pytest.importorskip("schedulefree")
pytestmark = pytest.mark.timeout(240)
BETA = 0.9  # AdamWScheduleFree's default beta1: y = (1 - BETA) z + BETA x


def _stepped(module: torch.nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    opt = schedulefree.AdamWScheduleFree(module.parameters(), lr=lr, warmup_steps=0)
    opt.train()
    for _ in range(2):  # after one step x = z = y; the second makes them differ
        opt.zero_grad()
        module(torch.ones(1, module.in_features)).pow(2).sum().backward()
        opt.step()
    return opt


def test_iterate_states_are_the_optimizers_z_and_a_scratch_copy_before_the_first_step() -> None:
    module = torch.nn.Linear(2, 1)
    assert iterate_states([torch.optim.AdamW(module.parameters())], list(module.parameters())) == []
    opt = schedulefree.AdamWScheduleFree(module.parameters(), lr=0.1)
    fresh = iterate_states([opt], list(module.parameters()))
    # not stepped: z would start at the parameters; a copy, so a merge writing it leaves the model alone
    assert all(torch.equal(z, p) and z.data_ptr() != p.data_ptr() for z, p in zip(fresh, module.parameters()))
    opt = _stepped(module)
    stepped = iterate_states([opt], list(module.parameters()))
    assert [z.data_ptr() for z in stepped] == [opt.state[p]["z"].data_ptr() for p in module.parameters()]


def test_a_merge_blends_z_like_the_parameters_and_leaves_it_out_of_the_restore_point() -> None:
    # One group of one rank (a FakeWorld): the merge's sums are over this rank alone. (A gloo group here would
    # leave its threads in this process when the test fails, and the forked ranks of the next test could then
    # deadlock instead of failing.)
    module = torch.nn.Linear(2, 1)
    opt = _stepped(module)
    theta, z = flat_params(module), torch.cat([opt.state[p]["z"].reshape(-1) for p in module.parameters()])
    assert not torch.allclose(theta, z.double())

    def merge_and_restore(executor) -> tuple[torch.Tensor, ...]:
        ops = _ShardRank(module, executor.hdet.groups.comm, 0, 1)
        ops.optimizers = [opt]
        ops.merger.merge([0.5], [0.25], [False])
        merged = (flat_params(module), torch.cat([opt.state[p]["z"].reshape(-1) for p in module.parameters()]),
                  ops.merger.restore_point.clone())
        ops.merger.restore()  # the roll-back restarts the optimizer: its z starts again from the restored parameters
        return merged

    (params, merged_z, restore_point), = FakeWorld([0.0], [1.0]).run(merge_and_restore)
    # one rank: target = 0.5 x own; each tensor moves (1 - 0.25) t + 0.25 target = 0.875 t, z as the parameters
    torch.testing.assert_close(params, 0.875 * theta)
    torch.testing.assert_close(merged_z, 0.875 * z)
    assert restore_point.tolist() == pytest.approx((0.5 * theta).tolist())  # the parameters only
    torch.testing.assert_close(flat_params(module), 0.5 * theta)
    assert not opt.state


class SFBoring(BoringModel):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return schedulefree.AdamWScheduleFree(self.parameters(), lr=0.05, warmup_steps=0)

    def on_train_start(self) -> None:
        self.trainer.optimizers[0].train()


class Iterates(Callback):
    """Per step: the parameters ``y`` and the optimizer's ``z`` (after HDET's merge of that step)."""

    def __init__(self, out) -> None:
        self.out, self.by_step = out, {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args) -> None:
        state = trainer.optimizers[0].state
        z = torch.cat([state[p]["z"].detach().reshape(-1).double() for p in pl_module.parameters()])
        self.by_step[trainer.global_step] = (flat_params(pl_module), z)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"by_step": self.by_step, "group": trainer.strategy.group_index},
                   self.out / f"rank{trainer.global_rank}.pt")


def test_groups_share_y_z_and_so_x_after_every_merge(tmp_path) -> None:
    """Two groups at LRs 1x and 4x vote every 4 steps (mean blend): between votes their ``z`` differ, after a
    vote every rank holds the same ``y`` and ``z``, hence the same average ``x = (y - (1 - beta) z) / beta``."""
    seed_everything(3)
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[1.0, 4.0], gradient_sync="group", start_method=START)
    callbacks = [HDETCallback(every_n_steps=4, vote=Softmax(blend="mean"), search=False), Iterates(tmp_path)]
    Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs(max_steps=8)).fit(SFBoring())
    ranks = load_ranks(tmp_path, 4)
    assert [r["group"] for r in ranks] == [0, 0, 1, 1]
    _, z0 = ranks[0]["by_step"][3]
    _, z2 = ranks[2]["by_step"][3]
    assert not torch.allclose(z0, z2)  # the groups trained apart
    for step in (4, 8):  # the vote at step 4 and the final merge at the end of fit
        y, z = ranks[0]["by_step"][step]
        for r in ranks[1:]:
            torch.testing.assert_close(r["by_step"][step][0], y)
            torch.testing.assert_close(r["by_step"][step][1], z)
        x = (y - (1 - BETA) * z) / BETA
        assert torch.isfinite(x).all()
