import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import seed_everything

from lightning_hdet.demos import CharCorpusDataModule, ShapesCNN, ShapesDataModule, make_shapes
from lightning_hdet.demos.shapes import CLASSES
from tests.helpers import TrainLosses, quiet_trainer


def test_make_shapes_is_deterministic_per_seed():
    x, y = make_shapes(64, size=16, seed=3)
    x2, y2 = make_shapes(64, size=16, seed=3)
    assert x.shape == (64, 1, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = make_shapes(64, size=16, seed=4)
    assert not torch.equal(x, x3)
    assert 0 <= int(y.min()) and int(y.max()) < len(CLASSES)


def test_every_class_draws_its_own_mask_without_noise():
    x, y = make_shapes(600, size=16, noise=0.0, seed=0)
    assert set(y.tolist()) == set(range(len(CLASSES)))  # all classes present, roughly balanced
    assert min(torch.bincount(y).tolist()) > 600 / len(CLASSES) / 2
    lit = (x[:, 0] > 0).flatten(1).sum(1).float()
    assert bool((lit > 0).all())  # every image shows its shape
    # A disc of radius r lights about pi r^2 pixels, a ring of the same radius far fewer.
    disc, ring = lit[y == CLASSES.index("disc")].mean(), lit[y == CLASSES.index("ring")].mean()
    assert disc > 1.3 * ring


def test_datamodule_splits_are_distinct_and_reproducible():
    a, b = ShapesDataModule(batch_size=8, num_train=32, num_val=16), ShapesDataModule(batch_size=8, num_train=32, num_val=16)
    a.setup("fit"), b.setup("fit")
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert len(a.train_set) == 32 and len(a.val_set) == 16
    assert not torch.equal(a.train_set.tensors[0][:16], a.val_set.tensors[0])
    assert ShapesDataModule.num_classes == len(CLASSES)
    with pytest.raises(ValueError, match="batch_size"):
        ShapesDataModule(batch_size=0)


@pytest.mark.parametrize("make", [lambda **kw: ShapesDataModule(batch_size=8, num_train=64, num_val=8, **kw),
                                  lambda **kw: CharCorpusDataModule(block_size=16, batch_size=8, max_chars=20_000, **kw)],
                         ids=["shapes", "char_lm"])
def test_a_shuffle_seed_fixes_the_training_order_whatever_the_global_rng(make):
    """A launched rank re-seeds the global RNG after the model was built; with ``shuffle_seed`` the order does not
    depend on it (benchmarks compare one-process runs with the ranks of a job), without it it does."""

    def first_labels(global_seed: int, **kw) -> list[int]:
        dm = make(**kw)
        dm.setup("fit")
        torch.manual_seed(global_seed)
        return [int(y.flatten()[0]) for _, y in dm.train_dataloader()][:6]

    assert first_labels(1, shuffle_seed=5) == first_labels(2, shuffle_seed=5)
    assert first_labels(1, shuffle_seed=5) != first_labels(1, shuffle_seed=6)
    assert first_labels(1) != first_labels(2)
    with pytest.raises(ValueError, match=r"`shuffle_seed` must be an int or None, got '5'\."):
        make(shuffle_seed="5")


@pytest.mark.parametrize("make", [lambda **kw: ShapesDataModule(batch_size=4, num_train=64, num_val=8, **kw),
                                  lambda **kw: CharCorpusDataModule(block_size=16, batch_size=4, max_chars=20_000, **kw)],
                         ids=["shapes", "char_lm"])
def test_shard_train_gives_each_rank_its_own_training_shard_and_the_whole_validation_set(make):
    """What HDET's groups need under ``gradient_sync="global"``: the gradient averages disjoint shards, while every
    rank validates on the same batches (``use_distributed_sampler=False`` leaves validation alone)."""

    def loaders(rank: int, world: int, **kw):
        dm = make(shuffle_seed=3, **kw)
        dm.trainer = SimpleNamespace(world_size=world, global_rank=rank)
        dm.setup("fit")
        return dm, dm.train_dataloader(), dm.val_dataloader()

    dm, *_ = loaders(0, 1)
    size = len(dm.train_set)
    shards = [list(iter(loader.sampler)) for _, loader, _ in (loaders(r, 2, shard_train=True) for r in range(2))]
    assert len(shards[0]) == len(shards[1]) == size // 2
    assert not set(shards[0]) & set(shards[1])  # disjoint: the global gradient averages twice the batch
    assert shards[0] == list(iter(loaders(0, 2, shard_train=True)[1].sampler))  # the same order on every call
    vals = [[y.tolist() for _, y in loaders(r, 2, shard_train=True)[2]] for r in range(2)]
    assert vals[0] == vals[1] and sum(len(v) for v in vals[0]) == len(dm.val_set)  # whole, on every rank
    # Without shard_train, or with one process, every rank reads the whole training set in the seed's order.
    whole = [[y.tolist() for _, y in loaders(r, 2)[1]] for r in range(2)]
    assert whole[0] == whole[1] == [y.tolist() for _, y in loaders(0, 1, shard_train=True)[1]]
    with pytest.raises(ValueError, match=r"`shard_train` must be True or False, got 1\."):
        make(shard_train=1)


def test_a_few_adamw_steps_reduce_the_loss():
    seed_everything(0)
    model = ShapesCNN(width=8, lr=1e-2)
    record = TrainLosses()
    trainer = quiet_trainer(devices=1, max_steps=60, limit_val_batches=0, callbacks=[record])
    trainer.fit(model, ShapesDataModule(batch_size=32, num_train=2048, num_val=64, noise=0.2))
    first, last = sum(record.losses[:5]) / 5, sum(record.losses[-5:]) / 5
    assert first == pytest.approx(math.log(len(CLASSES)), abs=0.15)  # starts near chance
    assert last < first - 0.1


def test_model_rejects_unknown_optimizer_and_bad_lr():
    with pytest.raises(ValueError, match="optimizer"):
        ShapesCNN(optimizer="adam9")
    with pytest.raises(ValueError, match="lr"):
        ShapesCNN(lr=0)
    with pytest.raises(ValueError,
                       match=r"`scheduler` must be one of \('constant', 'cosine'\), got 'cos'. Did you mean 'cosine'\?"):
        ShapesCNN(scheduler="cos")


@pytest.mark.parametrize("optimizer, module", [("prodigy", "prodigyopt"), ("schedulefree", "schedulefree")])
def test_self_tuning_optimizers_train_and_schedule_free_ends_on_its_average(optimizer, module):
    pytest.importorskip(module)
    seed_everything(0)
    model = ShapesCNN(width=8, lr=1.0 if optimizer == "prodigy" else 1e-2, optimizer=optimizer)
    trainer = quiet_trainer(devices=1, max_steps=6, limit_val_batches=1, val_check_interval=3, check_val_every_n_epoch=None)
    trainer.fit(model, ShapesDataModule(batch_size=16, num_train=256, num_val=16))
    opt = trainer.optimizers[0]
    assert math.isfinite(float(trainer.callback_metrics["val_loss"]))
    if optimizer == "schedulefree":
        assert opt.param_groups[0]["train_mode"] is False  # the averaged weights are handed back
    else:
        assert opt.param_groups[0]["d"] > 0  # Prodigy's own step-size estimate
