import math

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from lightning_hdet.demos import CharCorpusDataModule, CharLM
from tests.helpers import START, TrainLosses, quiet_trainer

TINY = dict(block_size=32, d_model=32, n_layers=1, n_heads=2)


def test_causal_outputs_do_not_see_the_future():
    model = CharLM(**TINY).eval()
    x = torch.randint(0, 256, (2, 32))
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :20], model(changed)[:, :20], atol=1e-6)
        assert not torch.allclose(model(x)[:, 20:], model(changed)[:, 20:])


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_loss_decreases_on_one_process(optimizer):
    seed_everything(0)
    lr = 3e-3 if optimizer == "adamw" else 0.3
    model = CharLM(**TINY, lr=lr, optimizer=optimizer)
    record = TrainLosses()
    trainer = quiet_trainer(devices=1, max_steps=30, limit_val_batches=0, callbacks=[record])
    trainer.fit(model, CharCorpusDataModule(block_size=32, batch_size=16, max_chars=60_000))
    first, last = sum(record.losses[:5]) / 5, sum(record.losses[-5:]) / 5
    assert first > math.log(256) * 0.9  # starts near uniform over bytes
    assert last < first - 0.5


def test_cosine_schedule_warms_up_then_decays():
    model = CharLM(**TINY, lr=1e-2, scheduler="cosine", warmup_steps=5)
    lrs = []

    class _LR(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = quiet_trainer(devices=1, max_steps=20, limit_val_batches=0, callbacks=[_LR()])
    trainer.fit(model, CharCorpusDataModule(block_size=32, batch_size=4, max_chars=60_000))
    assert lrs[0] == pytest.approx(2e-3) and lrs[4] == pytest.approx(1e-2)
    assert lrs[-1] < lrs[5] and lrs[-1] >= 1e-3 - 1e-12


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"optimizer": "adam"}, "optimizer"), ({"scheduler": "step"}, "scheduler"), ({"lr": 0}, "lr")]
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CharLM(**kwargs)


class _SaveRank(Callback):
    def __init__(self, out):
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        state = {
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "weight": pl_module.head.weight.detach().clone(),
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.timeout(180)
def test_two_process_ddp_run(tmp_path):
    seed_everything(0)
    trainer = quiet_trainer(
        devices=2,
        strategy=DDPStrategy(start_method=START, process_group_backend="gloo"),
        max_steps=10,
        val_check_interval=10,
        limit_val_batches=3,
        callbacks=[_SaveRank(tmp_path)],
    )
    trainer.fit(CharLM(**TINY), CharCorpusDataModule(block_size=32, batch_size=8, max_chars=60_000))
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    for r in (r0, r1):
        assert math.isfinite(r["val_loss"]) and r["val_loss"] < math.log(256)
    # DDP keeps the replicas identical; each rank reports the loss on its own validation shard.
    assert torch.equal(r0["weight"], r1["weight"])
    assert r0["val_loss"] != r1["val_loss"]
