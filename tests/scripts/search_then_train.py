"""docs/hdet.md's search-then-train recipe, as a user runs it: one fit with the default ``strategy="hdet"`` launcher
(rank 0 is this process), a wide ``"group"`` search that the default ``HDETCallback()`` ends at ``max_steps // 2``, then
``"global"`` training around the LR it found. Rank 0 writes what the test asserts on to ``argv[1]``."""

import json
import sys
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hdet import HDETCallback, HDETStrategy  # noqa: E402
from tests.helpers import LinearModel  # noqa: E402


class Syncs(Callback):
    """The strategy's ``gradient_sync`` and the size of DDP's process group before every optimizer step."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        group = trainer.strategy.model.process_group  # the DistributedDataParallel wrapper's
        self.seen.append((trainer.strategy.gradient_sync, group.size()))


S, T = 16, 4
seed_everything(0)
syncs = Syncs()
callback = HDETCallback(every_n_steps=T)  # the default: search for half of max_steps, then train
trainer = Trainer(strategy=HDETStrategy(lr_multipliers=[3 ** (k - 0.5) for k in range(2)]),  # "group" by default
                  callbacks=[callback, syncs], max_steps=S, accelerator="cpu", devices=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, limit_val_batches=0)
trainer.fit(LinearModel(lr=0.02))
if trainer.global_rank == 0:
    with open(sys.argv[1], "w") as out:
        json.dump({"history": callback.history, "syncs": syncs.seen, "steps": trainer.global_step}, out)
