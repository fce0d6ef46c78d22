"""The end of an async or DiLoCo fit as the user sees it: the callbacks of the last step see the final global model,
rank 0's progress bar ends on the job's numbers (integers as integers, the budget done as the summary says) and the
run ends with Lightning's "`Trainer.fit` stopped" line. Two processes on gloo through Lightning's own launcher."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hdet import AsyncLocalSGDStrategy, SlowRanks
from benchmarks.common import adaptive_rounds
from tests.helpers import START, flat_params, load_ranks, trainer_kwargs


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class LastStep(Callback):
    """Each rank records the model its callbacks see at its last step (``on_train_batch_end``) and at
    ``on_train_end``, the progress bar's metrics and rank 0's log lines; written to ``out/rank{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.handler = Lines()
        logging.getLogger().addHandler(self.handler)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.last_batch = flat_params(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.train_end = flat_params(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        logging.getLogger().removeHandler(self.handler)
        strategy = trainer.strategy
        outer = strategy._outer
        torch.save({"last_batch": self.last_batch, "train_end": self.train_end, "fit_end": flat_params(pl_module),
                    "global": outer.params.double().clone() if outer is not None else None,
                    "progress": dict(trainer.progress_bar_metrics), "lines": self.handler.lines,
                    "result": strategy.result.to_dict() if strategy.result is not None else None,
                    "global_step": trainer.global_step}, self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, mode: str) -> list[dict[str, Any]]:
    seed_everything(0)
    strategy = AsyncLocalSGDStrategy(local_steps=adaptive_rounds(4, mode), mode=mode, start_method=START)
    # rank 1 twice as slow: in async mode rank 0 takes more of the budget, its global_step ends past max_steps
    trainer = Trainer(strategy=strategy, callbacks=[SlowRanks({1: 2.0}, base_seconds=0.01), LastStep(out)],
                      **trainer_kwargs(devices=2, max_steps=16))
    trainer.fit(BoringModel())
    return load_ranks(out, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_last_steps_callbacks_see_the_global_model_and_the_bar_ends_on_the_jobs_numbers(tmp_path: Path,
                                                                                           mode: str) -> None:
    ranks = _fit(tmp_path, mode)
    final = ranks[0]["global"]
    for rank in ranks:  # at its last step (the reply said stop) and at on_train_end, every rank holds the global model
        for when in ("last_batch", "train_end", "fit_end"):
            torch.testing.assert_close(rank[when], final, rtol=0, atol=0, msg=f"{when} of a rank")
    result, progress = ranks[0]["result"], ranks[0]["progress"]
    assert result["steps_done"] == result["budget"] == 2 * 16
    # integers stay integers; the budget done is what the summary says
    assert type(progress["async/slowest"]) is int and type(progress["async/outer_updates"]) is int
    assert progress["async/outer_updates"] == result["outer_updates"]
    assert progress["async/budget_done"] == result["steps_done"] / result["budget"] == 1.0
    stopped = [line for line in ranks[0]["lines"] if line.startswith("`Trainer.fit` stopped")]
    assert stopped == ["`Trainer.fit` stopped: the budget of `max_steps=16` (32 inner steps over 2 workers) is spent;"
                       f" `global_step` {ranks[0]['global_step']} counts rank 0's own steps."]
