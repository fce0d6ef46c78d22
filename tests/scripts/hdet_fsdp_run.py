"""Run by tests/test_hdet_fsdp.py under Lightning's subprocess launcher ("hdet_fsdp", as torchrun/SLURM users run
it): 4 CPU processes, 2 groups x 2 shards. Each scenario trains, checkpoints at step 3 (the end of epoch 0),
votes/merges every 2 steps and, if it resumes, resumes a second Trainer from the checkpoint. Each rank writes what
the test asserts on to ``OUT/SCENARIO/rank{r}.pt``.

Usage: ``python hdet_fsdp_run.py OUT SCENARIO [SCENARIO ...]``, a scenario being
``{global,group,group>global}:{strategy,configure_model}:{resume,no-resume}[:nan|schedulefree|validate|monitor]``.
The
scenarios run one after the other in the same 4 processes (one launch: starting 4 interpreters with torch and
Lightning is most of a scenario's time), each with its own strategy, callbacks and seed.
``group>global``: built with ``"group"``, switched to ``"global"`` by ``set_gradient_sync`` once the model is sharded,
before the first step; ``nan``: group 1's loss is NaN at step 3, learning rates move only by the safety net's cut
(``meta_lr=0``); ``schedulefree``: schedule-free AdamW instead of AdamW, its base iterate ``z`` recorded too;
``validate``: validation at every epoch's end (``val_loss`` over all ranks), the validated parameters recorded;
``monitor``: the same validation, voted on (``HDETCallback(monitor="val_loss")``), each rank's own loss recorded.
"""

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hdet import HDETCallback, HDETFSDPStrategy, Softmax  # noqa: E402
from tests.helpers import Regression  # noqa: E402

STEPS_PER_EPOCH = 3


class MLP(LightningModule):
    """A two-layer regression MLP with AdamW (the optimizer state is sharded too); even sizes so shards are halves."""

    def __init__(self, shard_in_configure_model: bool = False, nan_at: int = -1, schedule_free: bool = False,
                 validate: bool = False) -> None:
        super().__init__()
        self.shard_in_configure_model = shard_in_configure_model
        self.nan_at, self.schedule_free, self.validate = nan_at, schedule_free, validate
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.own: dict[int, float] = {}  # this rank's own (unsynced) validation loss, by step

    def configure_model(self) -> None:
        if self.shard_in_configure_model:  # as a ModelParallelStrategy user would
            mesh = self.device_mesh["shard"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x)[:, :1], y)
        if self.trainer.global_step == self.nan_at and self.trainer.strategy.group_index == 1:
            loss = loss * float("nan")  # both ranks of group 1: its gradients are NaN, group 0's are not
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.schedule_free:
            import schedulefree

            return schedulefree.AdamWScheduleFree(self.parameters(), lr=0.01, warmup_steps=0)
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def on_train_start(self) -> None:
        if self.schedule_free:
            self.trainer.optimizers[0].train()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=4 * 4 * STEPS_PER_EPOCH), batch_size=4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x)[:, :1], y)
        self.own[self.trainer.global_step] = float(loss)
        self.log("val_loss", loss, sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        # One batch per rank: 8 items under monitor (a fit's validation is split over the group's two ranks), else 4
        return DataLoader(Regression(n=16, seed=1) if self.validate else [], batch_size=8)


def full(module: torch.nn.Module) -> torch.Tensor:
    """The full parameters (a collective over the shard group: every rank calls it at the same steps)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in module.parameters()])


class Probe(Callback):
    """Records full parameters at every step (``tag`` tells before or after HDETCallback's merge), losses, LRs."""

    def __init__(self, tag: str, record: dict[str, Any]) -> None:
        self.tag, self.record = tag, record

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record.setdefault("start", {})[self.tag] = full(pl_module)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.tag == "before":  # one entry per step
            self.record.setdefault("lrs", []).append(float(optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.record.setdefault(self.tag, {})[trainer.global_step] = full(pl_module)
        if pl_module.schedule_free:
            state = trainer.optimizers[0].state
            z = torch.cat([state[p]["z"].full_tensor().detach().reshape(-1) for p in pl_module.parameters()])
            self.record.setdefault(f"{self.tag}_z", {})[trainer.global_step] = z
        if self.tag == "before":
            self.record.setdefault("losses", {})[trainer.global_step] = float(outputs["loss"])

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        # At the first batch: the model validated (FSDP2 may leave later batches' parameters unsharded after a forward).
        if self.tag == "before" and not trainer.sanity_checking and batch_idx == 0:
            self.record.setdefault("validated", {})[trainer.global_step] = full(pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.tag == "before" and not trainer.sanity_checking:
            self.record.setdefault("val_loss", {})[trainer.global_step] = float(trainer.callback_metrics["val_loss"])


class SwitchToGlobal(Callback):
    """``set_gradient_sync("global")`` on the sharded model, before the first step (what ``search_steps`` calls)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy.set_gradient_sync("global")


def fit(out: Path, sync: str, shard_where: str, ckpt: Any, record: dict[str, Any], nan: bool = False,
        schedule_free: bool = False, validate: bool = False, monitor: bool = False) -> Trainer:
    seed_everything(3)
    first, _, later = sync.partition(">")
    strategy = HDETFSDPStrategy(num_groups=2, lr_multipliers=[1.0, 3.0], gradient_sync=first,
                                auto_wrap_policy={torch.nn.Linear})
    vote = Softmax(meta_lr=0.0, permute=False) if nan else Softmax()
    hdet = HDETCallback(every_n_steps=2, vote=vote, search=False, monitor="val_loss" if monitor else None)
    callbacks = [Probe("before", record), hdet, Probe("after", record), *([SwitchToGlobal()] if later else [])]
    if ckpt is None:
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=2 * STEPS_PER_EPOCH,
                      callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=ckpt is None, default_root_dir=out, limit_val_batches=1.0 if validate or monitor else 0)
    model = MLP(shard_where == "configure_model", nan_at=3 if nan else -1, schedule_free=schedule_free,
                validate=validate or monitor)
    trainer.fit(model, ckpt_path=ckpt)
    record["local_numel"] = sum(p.to_local().numel() for p in model.parameters())
    record["numel"] = sum(p.numel() for p in model.parameters())
    record["group_index"] = strategy.group_index
    record["final"] = full(model)
    record["skipped"] = strategy.skipped_steps
    record["own_val"], record["history"] = model.own, hdet.history
    return trainer


def scenario_dir(out: Path, scenario: str) -> Path:
    """Where a scenario's checkpoints and per-rank records go (``group>global:...`` -> ``group-global_...``)."""
    return out / scenario.replace(">", "-").replace(":", "_")


def run(out: Path, scenario: str) -> None:
    sync, shard_where, resume, *extra = scenario.split(":")
    out = scenario_dir(out, scenario)
    first: dict[str, Any] = {}
    trainer = fit(out, sync, shard_where, None, first, nan=extra == ["nan"], schedule_free=extra == ["schedulefree"],
                  validate=extra == ["validate"], monitor=extra == ["monitor"])
    resumed: dict[str, Any] = {}
    if resume == "resume":
        fit(out, sync, shard_where, out / "ckpt" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt", resumed)
    torch.save({"first": first, "resumed": resumed}, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(Path(sys.argv[1]), name)
