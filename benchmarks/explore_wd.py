"""Exploring the weight decay (``HDETStrategy(explore=...)``) where weight decay matters: an overfitting MLP.

The workload: :class:`~lightning_hdet.demos.tabular.TabularMLP` (two hidden layers of 256, AdamW at lr 3e-3, the
user's weight decay 0.1) on 512 training rows of the tabular task with 20 % label noise, 600 optimizer steps on 2 CPU
processes (2 groups for HDET): it overfits hard, and a larger weight decay lowers the held-out loss a lot (plain
AdamW in a one-process pilot, seeds 0 and 1: test loss 3.4-3.6 at weight decay 0.1, 2.2-2.3 at 1, 1.4 at 10).
Arms, each at 3 seeds:

- **plain**: DDP at the user's LR and weight decay;
- **HDET LR**: ``HDETStrategy()`` (the 27x LR grid), the default vote (PBT) and search, voting every 50 steps on
  the validation loss (``HDETCallback(monitor="val_loss")``: weight decay is a regulariser, invisible to the
  training loss);
- **HDET LR+WD**: the same with ``explore={"weight_decay": 100.0}`` (0.1 x [0.1, 10] over the two groups);
- **HDET WD**: the weight decay alone, ``explore={"lr": 1.0, "weight_decay": 100.0}`` (every group at the user's LR,
  except where the safety net cuts it), the same with the plateau rule off (``SafetyNet(plateau=None)``) and with
  the safety net off (``safety_net=False``: the LR stays the user's; the weight decay's effect alone);
- **HDET LR, train-loss vote** and **HDET LR+WD, train-loss vote**: the first two HDET arms voting on the training
  loss (the default signal), to show why the monitor matters.

Reported: the test loss (4096 rows no run saw) of the model each run ends with (HDET: the merged model), median and
range over seeds, and the weight decay / LR HDET ended at. CPU seconds are process time of this process and its
children (the machine is shared: wall-clock is noise).

Run: ``python benchmarks/explore_wd.py [--seeds 0 1 2] [--steps 600] [--arms ...]`` (about 3 CPU minutes for all
arms; not part of ``make bench``). Results: docs/hdet.md, "Exploring more than the LR".
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import warnings

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from typing_extensions import override

from lightning_hdet import HDETCallback, HDETStrategy, SafetyNet
from lightning_hdet.demos.tabular import TabularDataModule, TabularMLP, make_tabular

ARMS = ("plain", "hdet_lr", "hdet_lr_wd", "hdet_wd", "hdet_wd_no_plateau", "hdet_wd_no_net", "hdet_lr_train",
        "hdet_lr_wd_train")
WITH_LR, ALONE = {"weight_decay": 100.0}, {"lr": 1.0, "weight_decay": 100.0}  # 0.1 x [0.1, 10] over 2 groups
EXPLORE = {"hdet_lr_wd": WITH_LR, "hdet_wd": ALONE, "hdet_wd_no_plateau": ALONE, "hdet_wd_no_net": ALONE,
           "hdet_lr_wd_train": WITH_LR}
WEIGHT_DECAY, LR, EVERY = 0.1, 3e-3, 50


def _strategy(arm: str):
    if arm == "plain":
        return "ddp_fork"
    return HDETStrategy(explore=EXPLORE.get(arm), start_method="fork")


def run(arm: str, seed: int, steps: int) -> dict:
    """One run: its test loss and, for HDET, the LR and weight decay of group 0 at the end."""
    seed_everything(seed, verbose=False)
    data = TabularDataModule(batch_size=64, num_train=512, num_val=1024, label_noise=0.2, seed=seed)
    model = TabularMLP(width=256, depth=2, lr=LR, weight_decay=WEIGHT_DECAY)
    callbacks = []
    if arm != "plain":
        monitor = None if arm.endswith("_train") else "val_loss"
        # The safety net cuts the LRs of groups it rescues (a rising validation loss counts) and, with its plateau
        # rule, of all groups when none improves: even with explore={"lr": 1.0}.
        net = {"hdet_wd_no_plateau": SafetyNet(plateau=None), "hdet_wd_no_net": False}.get(arm, True)
        callbacks += [HDETCallback(every_n_steps=EVERY, monitor=monitor, safety_net=net, seed=seed), _Ends()]
    trainer = Trainer(accelerator="cpu", devices=2, strategy=_strategy(arm), max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, check_val_every_n_epoch=None,
                      val_check_interval=EVERY // 2,  # a vote runs before its own step's validation: one between
                      callbacks=callbacks)
    trainer.fit(model, datamodule=data)
    x, y = make_tabular(4096, label_noise=0.2, seed=10_000 + seed, task_seed=seed)
    with torch.no_grad():
        test = float(F.cross_entropy(model.cpu()(x), y))
    out = {"test": test}
    if callbacks and os.path.exists(_ENDS):  # written by rank 0 (the fork launcher's main process has no history)
        out.update(torch.load(_ENDS))
        os.remove(_ENDS)
    return out


_ENDS = f"/tmp/explore_wd_ends_{os.getpid()}.pt"


class _Ends(Callback):
    """Rank 0 writes every group's LR and weight decay after the last vote."""

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        history = next(c for c in trainer.callbacks if isinstance(c, HDETCallback)).history
        if trainer.is_global_zero and history:
            last = [r for r in history if r["step"] == history[-1]["step"]]
            torch.save({"lr": [r["lr"] for r in last],
                        "wd": [r.get("explored", {}).get("weight_decay", WEIGHT_DECAY) for r in last]}, _ENDS)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    start = _cpu()
    results = {arm: [run(arm, s, args.steps) for s in args.seeds] for arm in args.arms}
    print(f"\nseeds {args.seeds}, {args.steps} steps, CPU {_cpu() - start:.0f} s (this process and its children)")
    print("| arm | test loss, median [min, max] | per seed | ends at (group 0): LR, weight decay |")
    print("|---|---|---|---|")
    for arm, rows in results.items():
        tests = [r["test"] for r in rows]
        ends = "; ".join(f"{r['lr'][0]:.2g}, {r['wd'][0]:.2g}" for r in rows if "lr" in r)
        ends = ends or f"{LR:g}, {WEIGHT_DECAY:g}"
        print(f"| {arm} | {statistics.median(tests):.3f} [{min(tests):.3f}, {max(tests):.3f}] | "
              f"{', '.join(f'{t:.3f}' for t in tests)} | {ends} |")


if __name__ == "__main__":
    main()
