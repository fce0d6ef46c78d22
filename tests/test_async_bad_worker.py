"""Issue 29 as a multi-process test (gloo, fork): one worker whose loss turns NaN cannot poison the global model,
in async Local-SGD and in DiLoCo; the others finish the budget."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy
from tests.helpers import START
from tests.test_async_defaults import SGDBoring, _loss

BAD_RANK, BAD_FROM = 1, 2  # rank 1's loss is NaN from its 2nd step on (within its first round)


class NaNFrom(SGDBoring):
    """Lightning's BoringModel with SGD 0.05, whose loss on rank ``BAD_RANK`` is NaN from step ``BAD_FROM``."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        if self.global_rank == BAD_RANK and self.trainer.global_step >= BAD_FROM:
            out["loss"] = out["loss"] * math.nan
        return out


class Record(Callback):
    """Every rank writes what its worker saw; rank 0 also the global model's loss and the outer side's counts."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.n_after_exclusion: list[int] = []  # rank 0: Delayed Nesterov's N at each step once rank 1 is out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        outer = trainer.strategy._outer
        if outer is not None and outer.excluded(BAD_RANK):
            self.n_after_exclusion.append(outer.optimizer.param_groups[0]["buffer_size"])

    def on_fit_end(self, trainer, pl_module):
        worker = trainer.strategy._exchange.worker
        record = {"discarded": worker.discarded, "rejected": worker.rejected, "inner_steps": worker.inner_steps}
        if trainer.global_rank == 0:
            outer = trainer.strategy._outer
            record.update(loss=_loss(pl_module), steps_done=outer.steps_done, n=self.n_after_exclusion,
                          stats={w: vars(s) for w, s in outer.workers.items()})
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_nan_worker_is_rejected_and_stopped_while_the_others_finish(tmp_path: Path, mode: str) -> None:
    """3 workers, H = 4 (fixed round lengths: rank 1 must not run out of budget before it goes bad, however slow
    the loaded machine makes it), a 3 x 40 step budget. Rank 1 discards its non-finite rounds itself (it never
    pushes NaN), is told each time, and stops after 3 in a row; the global model is finite and better than at the start,
    the rejections are in the logged metrics, the healthy workers spend the budget, and async's N follows the two
    left. (The "robust" outer settings in both modes: with DiLoCo's published ones this toy run diverges on 2
    healthy workers alone.)"""
    seed_everything(0)
    model = NaNFrom()
    initial = _loss(model)
    trainer = Trainer(strategy=AsyncLocalSGDStrategy(local_steps=4, mode=mode, outer="robust",
                                                   start_method=START),
                      accelerator="cpu", devices=3, max_steps=40, limit_val_batches=0, num_sanity_val_steps=0,
                      logger=CSVLogger(tmp_path, name="logs"), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, callbacks=[Record(tmp_path)])
    trainer.fit(model)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert math.isfinite(ranks[0]["loss"]) and ranks[0]["loss"] < initial
    bad = ranks[0]["stats"][str(BAD_RANK)]
    assert bad["rejected"] == bad["rejected_streak"] == 3 and ranks[BAD_RANK]["discarded"] == 3
    assert ranks[BAD_RANK]["rejected"] == 3 and bad["steps"] == 0  # none of its rounds counted
    healthy = [ranks[0]["stats"][w]["steps"] for w in ("0", "2")]
    assert ranks[0]["steps_done"] == sum(healthy) and ranks[0]["steps_done"] > 120 - 2 * 4
    with open(next((tmp_path / "logs").glob("version_*/metrics.csv"))) as f:
        logged = [float(row["async/worker1/rejected"]) for row in csv.DictReader(f) if row.get("async/worker1/rejected")]
    assert max(logged) == 3.0
    # async: Delayed Nesterov's N follows the two workers left (from a momentum boundary); DiLoCo's is 1
    assert 2 in ranks[0]["n"] if mode == "async" else set(ranks[0]["n"]) == {1}
    for p in model.parameters():  # every rank ends with the global model, rank 0's included
        assert torch.isfinite(p).all()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["nan", "huge"])
@pytest.mark.parametrize("path", ["async", "diloco", "elastic"])
def test_two_workers_left_by_a_bad_third_keep_improving_over_a_long_run(tmp_path: Path, path: str, fault: str) -> None:
    """Issue 42: three workers, 60 rounds (H = 8) per healthy worker, at the defaults, in the Trainer (async and
    DiLoCo) and in the elastic mode. The third worker goes bad: its loss NaN from its 2nd step on (it discards its
    rounds itself), or its parameters moved by 100 at every step from its 26th (finite pushes that only the outer
    side's norm check stops). It is stopped after three rejections in a row; the two left spend the budget and the
    global model keeps improving. Before the stable outer step the elastic runs of the issue ended above their
    start (1.26-8.76)."""
    from benchmarks.bad_worker_paths import fit_elastic, fit_trainer

    budget, h = 960, 8
    if path == "elastic":
        record = fit_elastic(3, budget, 0, fault, work=tmp_path, every=budget // (2 * h),
                             local_steps=AdaptiveSteps(h))
        assert record["exit_codes"] == [0, 0, 0, 0]
        assert list(record["ended"].values()).count("excluded: 3 pushes in a row rejected") == 1
    else:
        record = fit_trainer("sync" if path == "diloco" else "async", 3, budget, 0, fault, work=tmp_path,
                             every=budget // 2, local_steps=h if path == "diloco" else AdaptiveSteps(h))
    bad = [s for s in record["workers"].values() if s["rejected"]]
    assert len(bad) == 1 and bad[0]["rejected"] == 3  # stopped
    assert (bad[0]["steps"] == 0) == (fault == "nan")  # none of a NaN worker's rounds applied; a huge one's first
    assert record["steps_done"] == budget
    (middle, *_), end = record["curve"], record["final"]
    # measured at the default (seed 0), NaN: end 2.2e-4 (async), 2.9e-5 (DiLoCo), 3.7e-3 (elastic) from 1.2; at the
    # defaults before (lr 0.7: "robust" async and elastic, "published" DiLoCo) 0.0082 (async: passes), 67, 118;
    # async fails at "published" (2.06)
    assert end < 0.1 * record["initial"]
    assert end < middle[1]  # the loss still falls over the second half
