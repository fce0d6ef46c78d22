"""HDETStrategy: registration, groups, divergent learning rates (multi-process on CPU with gloo)."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_hdet
from lightning_hdet import HDETCallback, HDETStrategy, Search
from tests.helpers import START, LinearModel, Recorder, SGDBoring, load_ranks, make_scheduler, trainer_kwargs

pytestmark = pytest.mark.timeout(240)


def _fit(tmp_path, strategy, model=None, callbacks=(), **kw):
    seed_everything(7)
    model = model or SGDBoring()
    trainer = Trainer(strategy=strategy, callbacks=[*callbacks, Recorder(tmp_path)], **trainer_kwargs(**kw))
    trainer.fit(model)
    return load_ranks(tmp_path, trainer_kwargs(**kw)["devices"])


def test_registered_names_and_instance():
    assert "hdet" in StrategyRegistry and "hdet_spawn" in StrategyRegistry
    assert StrategyRegistry["hdet"]["init_params"] == {"start_method": "popen"}
    assert StrategyRegistry["hdet_published"]["init_params"] == {"preset": "published"}
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy  # nothing existing is clobbered
    trainer = Trainer(strategy="hdet", accelerator="cpu", devices=4, logger=False)
    assert isinstance(trainer.strategy, HDETStrategy) and trainer.strategy.num_groups == 4
    trainer = Trainer(strategy=HDETStrategy(num_groups=2, lr_multipliers=[1, 3]), accelerator="cpu", devices=4,
                      logger=False)
    assert trainer.strategy.layout.group_size == 2
    assert trainer.strategy.lr_multipliers[:, 0].tolist() == [1.0, 3.0]


def test_cli_style_construction():
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--strategy", type=HDETStrategy)
    cfg = parser.parse_args(["--strategy=lightning_hdet.HDETStrategy", "--strategy.num_groups=2",
                             "--strategy.lr_multipliers=[1, 0.5]", "--strategy.gradient_sync=group"])
    strategy = parser.instantiate_classes(cfg).strategy
    assert isinstance(strategy, HDETStrategy)
    assert (strategy.gradient_sync, strategy._requested_groups) == ("group", 2)


def test_fan_out_default_multipliers():
    strategy = Trainer(strategy=HDETStrategy(spread=0.2), accelerator="cpu", devices=4, logger=False).strategy
    m = strategy.lr_multipliers[:, 0]
    assert m.tolist() == pytest.approx([0.8, 0.8 + 0.4 / 3, 1.2 - 0.4 / 3, 1.2])
    assert float(m.mean()) == pytest.approx(1.0)


def test_the_initial_multipliers_by_hand():
    """What the groups start at, in order of precedence: the requested ones, `explore={"lr": span}`'s grid, the
    published spread's fan-out, the preset's grid (clusters: the user's LR on the middle groups)."""
    from lightning_hdet.hdet.layout import initial_multipliers

    assert initial_multipliers(2, [1.0, 3.0], 0.5, 9.0, True, 27.0) == [1.0, 3.0]
    assert initial_multipliers(2, None, 0.5, 9.0, False, 27.0) == pytest.approx([1.0, 3.0])  # 9 ** (0, 1/2)
    assert initial_multipliers(3, None, 0.5, None, False, None) == pytest.approx([0.5, 1.0, 1.5])
    assert initial_multipliers(4, None, None, None, False, 16.0) == pytest.approx([0.5, 1.0, 2.0, 4.0])
    assert initial_multipliers(4, None, None, None, True, 16.0) == pytest.approx([0.25, 1.0, 1.0, 4.0])


def test_group_sync_params_equal_within_groups_and_differ_across(tmp_path):
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[1.0, 4.0], gradient_sync="group", start_method=START)
    ranks = _fit(tmp_path, strategy, callbacks=[HDETCallback(every_n_steps=1000)])
    last = max(ranks[0]["params_by_step"])
    p = [r["params_by_step"][last] for r in ranks]
    assert [r["group_index"] for r in ranks] == [0, 0, 1, 1]
    assert [r["group_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert torch.equal(p[0], p[1]) and torch.equal(p[2], p[3])
    assert not torch.allclose(p[0], p[2])
    # group gradients are reduced inside the group only: ranks of different groups see different gradients
    assert torch.equal(ranks[0]["grads"][-1], ranks[1]["grads"][-1])
    assert not torch.allclose(ranks[0]["grads"][-1], ranks[2]["grads"][-1])
    # at the end of fit every rank holds the merged model
    assert all(torch.equal(r["final_params"], ranks[0]["final_params"]) for r in ranks)


def test_global_sync_same_gradients_and_lr_ratio(tmp_path):
    mult = [0.5, 3.0]
    strategy = HDETStrategy(lr_multipliers=mult, gradient_sync="global", start_method=START)
    ranks = _fit(tmp_path, strategy, callbacks=[HDETCallback(every_n_steps=1000)], devices=2)
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["grads"], ranks[0]["grads"]))
    first, last = min(ranks[0]["params_by_step"]), max(ranks[0]["params_by_step"])
    # theta_0 = params before the first step: recover it from rank 0's first update and its gradient
    theta0 = ranks[0]["params_by_step"][first] + 0.1 * mult[0] * ranks[0]["grads"][0]
    steps = [(r["params_by_step"][last] - theta0) / m for r, m in zip(ranks, mult)]
    for s in steps[1:]:
        torch.testing.assert_close(s, steps[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ranks[0]["params_by_step"][last], ranks[1]["params_by_step"][last])


def test_search_steps_end_the_search_on_the_winner_and_switch_to_global_gradients(tmp_path):
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[1.0, 4.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=3, search=Search(steps=3, refine_spread=2.0))
    # least squares learns fast enough that the winner is below its first step's loss (less the noise) at step 3
    ranks = _fit(tmp_path, strategy, model=LinearModel(lr=0.1), callbacks=[callback], max_steps=8)
    # the search (steps 1-3): gradients reduced inside each group only
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["grads"][:3], ranks[1]["grads"][:3]))
    assert not any(torch.allclose(a, b) for a, b in zip(ranks[0]["grads"][:3], ranks[2]["grads"][:3]))
    # the vote at step 3 ended it: every rank holds the winner's model ...
    assert all(torch.equal(r["params_by_step"][3], ranks[0]["params_by_step"][3]) for r in ranks)
    vote = [h for h in ranks[0]["history"] if h["step"] == 3]
    winner = vote[0]["winner"]
    assert vote[winner]["loss"] == min(h["loss"] for h in vote)
    # ... the LRs are a grid of ratio 2 around the winner's, and every later step averages over all four ranks
    centre = 0.1 * [1.0, 4.0][winner]
    assert [h["lr"] for h in vote] == pytest.approx([centre / 2**0.5, centre * 2**0.5])
    assert [r["effective_lrs"][3][0] for r in ranks] == pytest.approx([vote[g]["lr"] for g in (0, 0, 1, 1)])
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["grads"][3:], ranks[0]["grads"][3:]))
    assert len(ranks[0]["grads"]) == 8


def test_spread_zero_reproduces_ddp_bit_for_bit(tmp_path):
    ddp = _fit(tmp_path / "ddp", DDPStrategy(start_method=START, process_group_backend="gloo"), devices=2)
    hdet = _fit(tmp_path / "hdet", HDETStrategy(spread=0.0, gradient_sync="global", start_method=START),
                callbacks=[HDETCallback(every_n_steps=1000)], devices=2)
    last = max(ddp[0]["params_by_step"])
    for a, b in zip(ddp, hdet):
        assert torch.equal(a["params_by_step"][last], b["params_by_step"][last])


def _reference_schedule(name: str, lr: float, two_groups: bool, steps: int) -> list[list[float]]:
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": lr * 0.1}] if two_groups else [
        {"params": params}]
    opt = torch.optim.SGD(groups, lr=lr)
    sched = make_scheduler(name, opt)
    out = []
    for _ in range(steps + 1):
        out.append([pg["lr"] for pg in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(("scheduler", "two_groups"), [("step", False), ("onecycle", True)])
def test_effective_lr_is_schedule_times_multiplier(tmp_path, scheduler, two_groups):
    mult = [0.1, 5.0]
    model = SGDBoring(lr=0.01, scheduler=scheduler, two_groups=two_groups)
    ranks = _fit(tmp_path, HDETStrategy(lr_multipliers=mult, start_method=START), model=model,
                 callbacks=[HDETCallback(every_n_steps=1000)], max_steps=6, devices=2)
    ref = _reference_schedule(scheduler, 0.01, two_groups, 6)
    for r in ranks:
        m = mult[r["group_index"]]
        assert len(r["effective_lrs"]) == 6
        for step, lrs in enumerate(r["effective_lrs"]):
            assert lrs == pytest.approx([x * m for x in ref[step]], rel=1e-12)
        # the optimizer and the scheduler never see the multiplier
        assert r["schedule_lrs"][-1] == pytest.approx(ref[6], rel=1e-12)
        assert r["sched_last_lr"][0] == pytest.approx(ref[6], rel=1e-12)


def test_bf16_accumulation_and_clipping(tmp_path):
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[1.0, 2.0], gradient_sync="group", start_method=START)
    ranks = _fit(tmp_path, strategy, callbacks=[HDETCallback(every_n_steps=1000)], precision="bf16-mixed",
                 accumulate_grad_batches=2, gradient_clip_val=0.5, max_steps=4)
    assert all(r["global_step"] == 4 for r in ranks)
    assert all(len(r["effective_lrs"]) == 4 for r in ranks)
    assert [r["effective_lrs"][0][0] for r in ranks] == pytest.approx([0.1, 0.1, 0.2, 0.2])
    last = max(ranks[0]["params_by_step"])
    p = [r["params_by_step"][last] for r in ranks]
    assert torch.equal(p[0], p[1]) and torch.equal(p[2], p[3]) and not torch.allclose(p[0], p[2])
    assert all(bool(torch.isfinite(r["final_params"]).all()) for r in ranks)
    # gradients were clipped to norm 0.5 before the step: no update is longer than lr * 0.5
    for r in ranks:
        lr = r["effective_lrs"][0][0]
        steps = sorted(r["params_by_step"])
        for a, b in zip(steps, steps[1:]):
            assert float((r["params_by_step"][b] - r["params_by_step"][a]).norm()) <= lr * 0.5 * (1 + 1e-4)
    assert max(float(g.norm()) for r in ranks for g in r["grads"]) > 0.5  # so clipping mattered


@pytest.mark.parametrize(
    ("kwargs", "devices", "match"),
    [
        (dict(num_groups=3), 4, "does not divide the world size 4"),
        (dict(num_groups=8), 4, "larger than the number of ranks"),
        (dict(num_groups=0), 4, "`num_groups` must be a positive integer"),
        (dict(num_groups=2, lr_multipliers=[1.0, 2.0, 3.0]), 4, "exactly one multiplier per group"),
        (dict(lr_multipliers=[1.0, 2.0, 3.0]), 4, "`lr_multipliers` has 3 values, one group each, but 3 groups do "
                                                  "not divide the world size 4: give 1, 2 or 4 multipliers"),
        (dict(lr_multipliers=[1.0, 2.0, 3.0, 4.0]), 2, "give 1 or 2 multipliers, or run on a multiple of 4 processes"),
        (dict(lr_multipliers=[1.0, -2.0]), 4, "positive finite numbers"),
        (dict(lr_multipliers=[1.0, float("nan")]), 4, "positive finite numbers"),
        (dict(lr_multipliers=[1.0, float("inf")]), 4, "positive finite numbers"),
        (dict(spread=1.0), 4, r"`spread` must be a number in \[0, 1\)"),
        (dict(spread=-0.1), 4, r"`spread` must be a number in \[0, 1\)"),
        (dict(gradient_sync="local"), 4, "`gradient_sync` must be one of"),
    ],
)
def test_bad_input(kwargs, devices, match):
    with pytest.raises(ValueError, match=match):
        Trainer(strategy=HDETStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)


def test_single_process_warns_and_trains_plainly(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with pytest.warns(UserWarning, match="needs several data-parallel replicas"):
        trainer = Trainer(strategy=HDETStrategy(lr_multipliers=[1.0, 2.0]), **trainer_kwargs(devices=1))
    model = SGDBoring()
    trainer.fit(model)
    assert trainer.strategy.num_groups == 1 and trainer.strategy.lr_multiplier == 1.0
    assert trainer.global_step == 8
    trainer.validate(model, verbose=False)  # makes the same process groups again, without saying so again
    assert caplog.text.count("HDET: creating 1 process group of 1 rank each") == 1


def test_package_exports():
    assert lightning_hdet.HDETStrategy is HDETStrategy
