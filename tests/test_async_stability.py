"""Issue 42 as a multi-process test (gloo, fork): with two workers, the fewest there can be and the least averaging,
the default outer step keeps improving Lightning's BoringModel + SGD over a long run, in async Local-SGD and in
DiLoCo. Before the default outer lr (``outer="robust"`` in async, ``"published"`` in DiLoCo, both lr 0.7) this run
ended far above its start (the issue: 66-5,789 async, 80-84 DiLoCo, at 37 rounds per worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy
from tests.test_async_defaults import SGDBoring, _loss

H, ROUNDS = 8, 60  # rounds per worker: at the outer lr 0.7 two workers had diverged by 30 (benchmarks/outer_stability.py)


def _flat_loss(model: torch.nn.Module, flat: torch.Tensor) -> float:
    """:func:`_loss` of ``model`` with the flat global parameters ``flat`` in place of its own."""
    copy = type(model)()
    torch.nn.utils.vector_to_parameters(flat, copy.parameters())
    return _loss(copy)


class Halfway(Callback):
    """Rank 0 records the global model's loss once the pushes applied hold half the budget's inner steps, and at
    the end."""

    def __init__(self, out: Path, budget: int) -> None:
        self.out, self.budget, self.middle = out, budget, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        outer = trainer.strategy._outer
        if outer is not None and self.middle is None and outer.steps_done >= self.budget // 2:
            self.middle = (outer.steps_done, _flat_loss(pl_module, outer.global_model()[0]))

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"middle": self.middle, "end": _loss(pl_module),
                                            "steps": trainer.strategy._outer.steps_done}))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_two_workers_keep_improving_over_a_long_run_at_the_defaults(tmp_path: Path, mode: str) -> None:
    seed_everything(0)
    model = SGDBoring()
    initial = _loss(model)
    out = tmp_path / "record.json"
    Trainer(strategy=AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(H) if mode == "async" else H, mode=mode, start_method="fork"), accelerator="cpu",
            devices=2, max_steps=H * ROUNDS, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path, callbacks=[Halfway(out, 2 * H * ROUNDS)]).fit(model)
    record = json.loads(out.read_text())
    assert record["middle"] is not None and record["steps"] == 2 * H * ROUNDS
    # measured at the default (outer lr 0.163; seed 0, async's timing varies): halfway / end loss 0.021 / 0.0013 async,
    # 0.021 / 0.0013 DiLoCo (start 1.2); at 0.339 (the default before issue 42's elastic fix) 0.0085 / 0.00016 and
    # 0.084 / 0.010 async, 0.0019 / 1.6e-5 DiLoCo; at lr 0.7 ("robust" async, "published" DiLoCo) at 40 rounds per
    # worker: 0.98 / 48 async, 4.2 / 91 DiLoCo
    assert record["end"] < 0.1 * initial
    assert record["end"] < record["middle"][1]  # the loss still falls over the second half


@pytest.mark.timeout(120)
def test_two_elastic_workers_keep_improving_over_a_long_run_at_the_defaults(tmp_path: Path) -> None:
    """The same run in the elastic mode: an ``OuterService`` and two one-device worker jobs (forked, on loopback),
    each session its own data order; the service evaluates the global model halfway (in outer updates: one per
    push) and at the end."""
    from benchmarks.bad_worker_paths import fit_elastic

    budget = 2 * H * ROUNDS
    record = fit_elastic(2, budget, 0, None, work=tmp_path, every=ROUNDS, local_steps=AdaptiveSteps(H))
    assert record["exit_codes"] == [0, 0, 0] and record["steps_done"] == budget
    (middle, *_), end = record["curve"], record["final"]
    assert middle[0] == ROUNDS
    # measured at the default (outer lr 0.163): halfway / end 0.0083 / 2.8e-5 (start 1.2; seeds 1-7 of fit_elastic:
    # end 3e-6 - 5.4e-5 x the start); at 0.339 (the default before issue 42's elastic fix) 0.0015 / 0.00022 but also
    # 0.040 / 0.058 (stalled and rose in 9 of 16 runs); at outer="robust" (lr 0.7) 0.95 / 280
    assert end < 0.1 * record["initial"]
    assert end < middle[1]  # the loss still falls over the second half
