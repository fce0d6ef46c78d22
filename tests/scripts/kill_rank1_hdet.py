"""Run by tests/test_reliability.py: an HDET job under the subprocess launcher ("hdet", as torchrun/SLURM users
run it) whose rank 1 is SIGKILLed at step 3. The job must fail with an error, not hang."""

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hdet import HDETStrategy  # noqa: E402
from tests.helpers import LinearModel  # noqa: E402


class KillRank1(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    seed_everything(0)
    trainer = Trainer(strategy=HDETStrategy(timeout=timedelta(seconds=10)), accelerator="cpu", devices=2,
                      max_steps=50, callbacks=[KillRank1()], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LinearModel())
    print("FINISHED")  # must never be reached on rank 0
