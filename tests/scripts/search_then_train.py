"""docs/hdet.md's search-then-train recipe, as a user runs it: two fits with the default ``strategy="hdet"``
launcher (rank 0 is this process), a wide ``"group"`` search, then ``"global"`` training around the LR it found,
from the searched model. Rank 0 writes what the test asserts on to ``argv[1]``."""

import json
import sys
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hdet import HDETCallback, HDETStrategy  # noqa: E402
from tests.helpers import LinearModel, flat_params  # noqa: E402


class StartParams(Callback):
    """The parameters the second fit starts from (after wrapping, before its first step)."""

    def on_train_start(self, trainer, pl_module):
        self.params = flat_params(pl_module).tolist()


S, T = 16, 4
seed_everything(0)
model = LinearModel(lr=0.02)
quiet = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)

search = HDETCallback(every_n_steps=T, blend="best")
Trainer(strategy=HDETStrategy(lr_multipliers=[3 ** (k - 0.5) for k in range(2)], gradient_sync="group"),
        callbacks=[search], max_steps=S // 2, **quiet).fit(model)
last = [row for row in search.history if row["step"] == search.history[-1]["step"]]
model.hparams.lr = next(row["lr"] for row in last if row["group"] == row["winner"])
searched = flat_params(model).tolist()

start = StartParams()
train = Trainer(strategy=HDETStrategy(lr_multipliers=[1.5 ** (k - 0.5) for k in range(2)], gradient_sync="global"),
                callbacks=[HDETCallback(every_n_steps=T, blend="best"), start], max_steps=S // 2, **quiet)
train.fit(model)
if train.global_rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump({"searched_lrs": sorted({row["lr"] for row in search.history}), "chosen_lr": model.hparams.lr,
                   "searched": searched, "second_start": start.params, "steps": train.global_step,
                   "second_lrs": train.strategy.current_lrs()[:, 0].tolist()}, out)
