"""gradient_sync="cluster": which groups share a gradient, before and after a vote (pure, hand-computed), the votes
that keep, split and join clusters over FakeWorld, and the strategy's refusals and default grid."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_hdet import PBT, HDETCallback, HDETStrategy, Search
from lightning_hdet.experimental import Halving
from lightning_hdet.hdet.clusters import after_vote, check_clusters, equal_rows, next_clusters
from lightning_hdet.hdet.fsdp.strategy import HDETFSDPStrategy
from lightning_hdet.hdet.rules.controller import Decision
from lightning_hdet.hdet.rules.defaults import incumbent_grid, span_grid
from lightning_hdet.hdet.rules.selection import MergeStep
from lightning_hdet.testing import FakeWorld
from tests.helpers import START, LinearModel, Recorder, SGDBoring, load_ranks, trainer_kwargs

pytestmark = pytest.mark.timeout(240)


def _rows(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


def _decision(rows: torch.Tensor, copies=(), rescued=None, roll_back=False, from_initial=()) -> Decision:
    g = rows.shape[0]
    return Decision(step=8, losses=[1.0] * g, weights=[1.0 / g] * g, winner=0, multipliers=rows, lrs=[0.1] * g,
                    rescued=rescued or [False] * g, roll_back=roll_back, copies=list(copies),
                    from_initial=list(from_initial))


def test_in_a_fresh_run_groups_with_equal_rows_form_a_cluster():
    assert equal_rows(_rows(0.2, 1.0, 1.0, 5.0)) == [[0], [1, 2], [3]]
    assert equal_rows(_rows(1.0, 2.0, 1.0, 2.0)) == [[0, 2], [1, 3]]  # ranks 0, 2 and 1, 3: one job each
    two_columns = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 2.0]], dtype=torch.float64)
    assert equal_rows(two_columns) == [[0], [1, 2]]  # every column counts (param groups, explored values)


def test_a_vote_keeps_a_cluster_it_treats_alike_and_splits_one_it_does_not():
    rows, clusters = _rows(0.2, 1.0, 1.0, 5.0), [[0], [1, 2], [3]]
    # PBT: group 0 (the worst) copies group 3: the cluster is untouched
    assert after_vote(clusters, rows, _decision(rows, [MergeStep([0, 0, 0, 1], [1, 0, 0, 0])])) == clusters
    # group 1 copies group 3 and takes a new LR: it leaves; group 2 trains on alone
    moved = _rows(0.2, 4.16, 1.0, 5.0)
    assert after_vote(clusters, moved, _decision(moved, [MergeStep([0, 0, 0, 1], [0, 1, 0, 0])])) == [
        [0], [1], [2], [3]]
    # a copy into one member at its old LR still leaves the two holding different models
    assert after_vote(clusters, rows, _decision(rows, [MergeStep([0, 0, 0, 1], [0, 1, 0, 0])])) == [
        [0], [1], [2], [3]]
    # a rescued member restarts its optimizer: the other's moments differ from then on
    assert after_vote(clusters, rows, _decision(rows, rescued=[False, True, False, False])) == [[0], [1], [2], [3]]
    # new rows alone split (the same model, different LRs)
    assert after_vote(clusters, _rows(0.2, 1.0, 1.2, 5.0), _decision(_rows(0.2, 1.0, 1.2, 5.0))) == [
        [0], [1], [2], [3]]


def test_without_a_common_model_clusters_never_join_and_with_one_they_follow_the_rows():
    rows = _rows(1.0, 1.0, 1.0, 1.0)
    assert next_clusters([[0], [1], [2, 3]], rows, [None] * 4) == [[0], [1], [2, 3]]
    # a roll-back: every group took the restore point, group 3 the initial model (the plateau ladder)
    back = _decision(rows, roll_back=True, from_initial=[False, False, False, True])
    assert after_vote([[0], [1], [2, 3]], rows, back) == [[0, 1, 2], [3]]
    assert after_vote([[0], [1], [2], [3]], rows, _decision(rows, roll_back=True)) == [[0, 1, 2, 3]]
    alternating = _rows(1.0, 2.0, 1.0, 2.0)
    assert after_vote([[0], [1, 2, 3]], alternating, _decision(alternating, roll_back=True)) == [[0, 2], [1, 3]]


def test_a_group_that_copies_another_whole_at_its_rates_joins_its_cluster():
    rows = _rows(5.0, 1.0, 1.0, 5.0)  # group 0 took group 3's model and rates; 1 and 2 left alone
    whole = _decision(rows, [MergeStep([0, 0, 0, 1], [1, 0, 0, 0])])
    assert after_vote([[0], [1, 2], [3]], rows, whole) == [[0, 3], [1, 2]]
    # a perturbed LR, half a copy, or a source that was itself moved: no join
    moved = _rows(4.0, 1.0, 1.0, 5.0)
    assert after_vote([[0], [1, 2], [3]], moved, _decision(moved, [MergeStep([0, 0, 0, 1], [1, 0, 0, 0])])) == [
        [0], [1, 2], [3]]
    half = _decision(rows, [MergeStep([0, 0, 0, 1], [0.5, 0, 0, 0])])
    assert after_vote([[0], [1, 2], [3]], rows, half) == [[0], [1, 2], [3]]
    # group 0 copied group 3, which then copied group 1: 0 joins nobody, 3 joins 1's cluster
    chain = _decision(_rows(5.0, 1.0, 1.0, 1.0), [MergeStep([0, 0, 0, 1], [1, 0, 0, 0]),
                                                  MergeStep([0, 1, 0, 0], [0, 0, 0, 1])])
    assert after_vote([[0], [1, 2], [3]], _rows(5.0, 1.0, 1.0, 1.0), chain) == [[0], [1, 2, 3]]


@pytest.mark.parametrize("clusters", [[[0], [1, 1], [2]], [[0, 1]], [[0], [], [1, 2]], "0,1,2", [[0, 1, 2, 3]]])
def test_clusters_that_do_not_cover_every_group_once_are_refused(clusters):
    with pytest.raises(ValueError, match=r"`clusters`.*lists of group indices covering 0..2 once each"):
        check_clusters(clusters, 3)
    check_clusters([[0, 2], [1]], 3)  # any partition


def test_the_incumbent_grid_puts_the_users_lr_on_the_middle_groups():
    assert incumbent_grid(4, 27.0) == pytest.approx([27 ** -0.5, 1.0, 1.0, 27 ** 0.5])
    assert incumbent_grid(8, 16.0) == pytest.approx([0.25, 0.5, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0])  # two probes a side
    assert incumbent_grid(3, 27.0) == span_grid(3, 27.0)  # too few groups for a cluster beside a probe each way


def _losses(order):
    """A step moves group g's parameter by g + 1; its loss falls at the rate order[g] per step."""

    def step(executor, index):
        executor.params.add_(executor.group_index + 1)
        return 2.0 - 0.1 * order[executor.group_index] * index

    return step


def test_pbt_over_the_fake_keeps_the_incumbent_cluster_when_a_probe_loses_and_splits_it_when_a_member_does():
    vote = PBT(quantile=0.25, resample_probability=0.0)
    world = FakeWorld(params=[0.0], lr_multipliers=[0.2, 1.0, 1.0, 5.0], gradient_sync="cluster")
    assert world.clusters == [[0], [1, 2], [3]]
    world.fit(lambda: HDETCallback(every_n_steps=4, vote=vote, search=False), _losses([1, 2, 3, 4]), max_steps=5)
    assert world.clusters == [[0], [1, 2], [3]]  # group 0 (the worst) copied group 3 (the best)
    assert ("set_clusters", ((0,), (1, 2), (3,))) in world.calls

    world = FakeWorld(params=[0.0], lr_multipliers=[0.2, 1.0, 1.0, 5.0], gradient_sync="cluster")
    world.fit(lambda: HDETCallback(every_n_steps=4, vote=vote, search=False), _losses([2, 1, 3, 4]), max_steps=5)
    assert world.clusters == [[0], [1], [2], [3]]  # group 1 (the worst) copied group 3 and left its cluster


def test_cluster_is_refused_by_hdet_fsdp_and_warns_where_no_two_groups_share_their_rates():
    with pytest.raises(ValueError, match="`gradient_sync`.*'group' or 'global' with hdet_fsdp.*strategy='hdet'"):
        HDETFSDPStrategy(gradient_sync="cluster")
    with pytest.warns(UserWarning, match="no two groups share their rates"):
        Trainer(strategy=HDETStrategy(gradient_sync="cluster"), accelerator="cpu", devices=2, logger=False)
    trainer = Trainer(strategy=HDETStrategy(gradient_sync="cluster"), accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.lr_multipliers[:, 0].tolist() == pytest.approx(incumbent_grid(4, 27.0))
    assert trainer.strategy.clusters == [[0], [1, 2], [3]]


class _SplitAt(Callback):
    """At step ``at``, every group alone: the incumbent cluster's two groups become separate DDP jobs."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            trainer.strategy.set_clusters([[0], [1], [2], [3]])


def test_a_cluster_is_one_ddp_job_over_its_ranks_until_it_splits(tmp_path):
    """Four processes, the default grid of "cluster" (0.19, 1, 1, 5.2): ranks 1 and 2 share every gradient (and so
    hold one model) while the probes train alone; after the split at step 4 the two former members differ."""
    seed_everything(7)
    strategy = HDETStrategy(gradient_sync="cluster", start_method=START)
    callbacks = [HDETCallback(every_n_steps=1000, search=False), _SplitAt(4), Recorder(tmp_path)]
    Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs()).fit(SGDBoring())
    ranks = load_ranks(tmp_path, 4)
    grads = [r["grads"] for r in ranks]
    assert all(torch.equal(a, b) for a, b in zip(grads[1][:4], grads[2][:4]))  # one gradient for the cluster
    assert not any(torch.allclose(a, b) for a, b in zip(grads[0][:4], grads[1][:4]))  # a probe's own
    assert torch.equal(ranks[1]["params_by_step"][4], ranks[2]["params_by_step"][4])
    assert not any(torch.allclose(a, b) for a, b in zip(grads[1][4:], grads[2][4:]))  # each its own after the split
    assert not torch.allclose(ranks[1]["params_by_step"][8], ranks[2]["params_by_step"][8])
    assert [r["effective_lrs"][0][0] for r in ranks] == pytest.approx([0.1 * m for m in incumbent_grid(4, 27.0)])


def test_a_resumed_run_takes_its_clusters_from_the_checkpoint():
    """Split at the vote of step 4 and saved at 5; a fresh world starts with the incumbent cluster whole, and
    resuming from those checkpoints leaves it split, as the straight run is."""
    vote = PBT(quantile=0.25, resample_probability=0.0)

    def run(**kw):
        world = FakeWorld(params=[0.0], lr_multipliers=[0.2, 1.0, 1.0, 5.0], gradient_sync="cluster")
        world.fit(lambda: HDETCallback(every_n_steps=4, vote=vote, search=False), _losses([2, 1, 3, 4]),
                  max_steps=6, **kw)
        return world

    straight, half = run(), run(save_at=5)
    assert all(c["hdet"]["clusters"] == [[0], [1], [2], [3]] for c in half.checkpoints)
    resumed = run(resume=half.checkpoints)
    assert resumed.clusters == straight.clusters == [[0], [1], [2], [3]]


def test_halving_hands_the_losers_to_the_winners_clusters():
    """experimental.Halving over the fake: at step 4 the two worst groups (0, 1) copy the two best (3, 2) with their
    rates unchanged; group 0 joins group 3, group 1 stays with group 2 (it copied its own cluster's model)."""
    world = FakeWorld(params=[0.0], lr_multipliers=[0.2, 1.0, 1.0, 5.0], gradient_sync="cluster")
    world.fit(lambda: HDETCallback(every_n_steps=4, vote=Halving(), search=False), _losses([1, 2, 3, 4]), max_steps=5)
    assert world.table.get(1)[:, 0].tolist() == [5.0, 1.0, 1.0, 5.0]
    assert world.clusters == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="`quantile`"):
        Halving(quantile=0.7)


def test_the_search_ends_a_cluster_run_with_one_gradient_over_every_rank(tmp_path):
    seed_everything(7)
    strategy = HDETStrategy(gradient_sync="cluster", start_method=START)
    callbacks = [HDETCallback(every_n_steps=3, search=Search(steps=3, restart_below=None)), Recorder(tmp_path)]
    Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs()).fit(LinearModel(lr=0.1))
    grads = [r["grads"] for r in load_ranks(tmp_path, 4)]
    assert all(torch.equal(a, b) for a, b in zip(grads[1][:3], grads[2][:3]))  # the cluster, during the search
    assert not any(torch.allclose(a, b) for a, b in zip(grads[0][:3], grads[1][:3]))
    assert all(torch.equal(g[k], grads[0][k]) for g in grads for k in range(3, 8))  # every rank after it


def test_groups_that_differ_only_in_another_explored_hyperparameter_are_not_one_cluster():
    world = FakeWorld(params=[0.0], lr_multipliers=[1.0, 1.0, 1.0, 1.0], gradient_sync="cluster",
                      explore={"weight_decay": [1.0, 1.0, 3.0, 3.0]})
    assert world.clusters == [[0, 1], [2, 3]]
