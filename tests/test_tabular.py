"""The tabular demo: deterministic generated data, a learnable non-linear task, and its argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_hdet.demos import TabularDataModule, TabularMLP, make_tabular


def test_make_tabular_is_deterministic_and_seeds_rows_apart_from_the_task():
    x, y = make_tabular(256, features=6, classes=4, seed=3)
    x2, y2 = make_tabular(256, features=6, classes=4, seed=3)
    assert x.shape == (256, 6) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.allclose(x.mean(0), torch.zeros(6), atol=1e-5) and torch.allclose(x.std(0), torch.ones(6))
    assert not torch.equal(make_tabular(256, features=6, classes=4, seed=4)[0], x)
    assert 0 <= int(y.min()) and int(y.max()) < 4 and len(set(y.tolist())) == 4


def test_label_noise_flips_about_its_share_of_the_teachers_labels():
    clean = make_tabular(4000, label_noise=0.0)[1]
    noisy = make_tabular(4000, label_noise=0.5)[1]
    changed = float((clean != noisy).float().mean())  # a flip draws a random class: 7/8 of flips change it
    assert 0.5 * 7 / 8 - 0.04 < changed < 0.5 * 7 / 8 + 0.04


def test_the_mlp_learns_the_task_below_the_label_prior():
    torch.manual_seed(0)
    data = TabularDataModule(batch_size=128, num_train=2048, num_val=512)
    data.setup("fit")
    x, y = data.train_set.tensors
    prior = torch.bincount(y, minlength=8).float() / len(y)
    entropy = float(-(prior * prior.log()).sum())
    assert entropy < math.log(8)
    model = TabularMLP(width=32, lr=1e-2)
    opt = model.configure_optimizers()
    for step in range(150):
        idx = torch.arange(step * 128, (step + 1) * 128) % len(x)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad(), loss.backward(), opt.step()
    xv, yv = data.val_set.tensors
    with torch.no_grad():
        assert float(F.cross_entropy(model(xv), yv)) < 0.8 * entropy


@pytest.mark.parametrize(("call", "match"), [
    (lambda: make_tabular(1), "`num` must be"),
    (lambda: make_tabular(8, classes=1), "`classes` must be"),
    (lambda: TabularDataModule(label_noise=1.0), "`label_noise` must be"),
    (lambda: TabularDataModule(batch_size=0), "`batch_size` must be"),
    (lambda: TabularMLP(depth=0), "`depth` must be"),
    (lambda: TabularMLP(scheduler="linear"), r"`scheduler` must be one of \('constant', 'cosine'\), got 'linear'"),
])
def test_bad_arguments_name_themselves(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("scheduler", ["constant", "cosine"])
def test_the_scheduler_option_anneals_the_lr_to_zero_over_the_fit_or_keeps_it(scheduler):
    from tests.helpers import quiet_trainer

    model = TabularMLP(width=8, lr=0.02, scheduler=scheduler)
    trainer = quiet_trainer(devices=1, max_steps=10, limit_val_batches=0)
    trainer.fit(model, TabularDataModule(batch_size=16, num_train=64, num_val=16))
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    if scheduler == "cosine":  # CosineAnnealingLR with T_max = the fit's 10 steps: at zero after the last
        assert len(trainer.lr_scheduler_configs) == 1 and trainer.lr_scheduler_configs[0].interval == "step"
        assert lr == pytest.approx(0.0, abs=1e-12)
    else:
        assert trainer.lr_scheduler_configs == [] and lr == 0.02


def test_a_small_training_set_repeats_within_a_fit():
    data = TabularDataModule(batch_size=32, num_train=1024, num_val=512)
    data.setup("fit")
    assert len(data.train_set) == 1024 and len(data.val_set) == 512
    assert not torch.equal(data.train_set.tensors[0][:512], data.val_set.tensors[0])  # held out: other rows
