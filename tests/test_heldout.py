"""signal="heldout": the averaging rule, the bookkeeping and the vote (hand-computed), and the whole path on four
processes (gloo, forked by Lightning's multiprocessing launcher): every group's averaged iterate scored on the same
held-out batches."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_hdet import Best, HDETCallback, HDETStrategy
from lightning_hdet.experimental import Heldout
from lightning_hdet.hdet.averaging import ParameterAverage, average_weight
from lightning_hdet.hdet.lightning.heldout import HeldoutScorer
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.hdet.rules.signals import score
from tests.helpers import START, LinearModel, Regression, flat_params, trainer_kwargs

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ the averaging rule
def test_average_weight_is_uniform_then_exponential():
    assert [average_weight(k) for k in (1, 2, 3)] == [1 / 2, 1 / 3, 1 / 4]
    # EMA with decay 0.9: max(0.1, 1/(k+1)) -> uniform until 1/(k+1) < 0.1, i.e. from k = 10 on 0.1.
    assert average_weight(1, 0.9) == 0.5
    assert average_weight(9, 0.9) == pytest.approx(0.1)
    assert average_weight(20, 0.9) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="heldout_decay"):
        average_weight(1, 1.0)


def test_parameter_average_matches_hand_computed_mean_and_restarts():
    p = torch.nn.Parameter(torch.tensor([0.0, 4.0]))
    avg = ParameterAverage([p])
    for value in ([2.0, 4.0], [4.0, 1.0]):  # iterates after steps 1 and 2
        p.data.copy_(torch.tensor(value))
        avg.update()
    assert avg.average[0].tolist() == pytest.approx([2.0, 3.0])  # mean of [0,4], [2,4], [4,1]
    with avg.swapped_in():
        assert p.tolist() == pytest.approx([2.0, 3.0])
    assert p.tolist() == [4.0, 1.0]  # swapped back
    avg.restart()
    p.data.copy_(torch.tensor([0.0, 0.0]))
    avg.update()
    assert avg.average[0].tolist() == pytest.approx([2.0, 0.5]) and avg.count == 1


def test_parameter_average_ema_weights():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    avg = ParameterAverage([p], decay=0.5)
    for value in (4.0, 8.0):
        p.data.fill_(value)
        avg.update()
    # k=1: w = max(0.5, 1/2) = 0.5 -> 2; k=2: w = max(0.5, 1/3) = 0.5 -> 2 + 0.5 (8 - 2) = 5
    assert avg.average[0].item() == pytest.approx(5.0)


# ------------------------------------------------------------------ bookkeeping
def test_read_gives_each_group_its_mean_and_refuses_different_batches():
    table = torch.tensor([[3.0, 2.0, 10.0], [5.0, 2.0, 10.0]], dtype=torch.float64)
    assert HeldoutScorer.read(table) == [1.5, 2.5]
    with pytest.raises(MisconfigurationException, match="different held-out batches"):
        HeldoutScorer.read(torch.tensor([[3.0, 2.0, 10.0], [5.0, 2.0, 11.0]], dtype=torch.float64))


def test_missing_loss_and_missing_dataloader_name_the_argument():
    trainer = SimpleNamespace(global_step=0, val_dataloaders=None, global_rank=0)
    with pytest.raises(MisconfigurationException, match="heldout_loss"):
        HeldoutScorer(2, None).start(trainer, BoringModel())
    scorer = HeldoutScorer(2, None, loss=lambda module, batch: module.step(batch))
    scorer.start(trainer, BoringModel())
    with pytest.raises(MisconfigurationException, match="val_dataloaders"):
        scorer.row(trainer, BoringModel(), SimpleNamespace(root_device=torch.device("cpu")))


def test_config_checks_heldout_arguments():
    with pytest.raises(ValueError, match="heldout_batches"):
        Heldout(batches=0)
    with pytest.raises(ValueError, match="heldout_decay"):
        Heldout(decay=1.5)
    with pytest.raises(ValueError, match="held-out batches"):
        score([1.0, 1.0, 1.0, 1.0], "heldout", 4)


# ------------------------------------------------------------------ the vote
def _interval(heldout: Any, final: bool = False) -> Interval:
    return Interval(step=4, losses=[1.0, 2.0], finite=[True, True],
                    multipliers=torch.tensor([[1.0], [2.0]], dtype=torch.float64), schedule_lrs=[0.1],
                    shared_gradients=False, final=final, heldout=heldout)


def test_vote_ranks_groups_by_heldout_loss_not_training_loss():
    config = HDETConfig(every_n_steps=4, vote=Best(blend="best"), signal=Heldout())
    # Training loss favours group 0 (1.0 < 2.0); the averaged iterates' held-out loss favours group 1.
    decision = HDETController(config).decide(_interval([3.0, 2.5]))
    assert decision.winner == 1 and decision.coefficients == [0.0, 1.0]
    assert decision.losses == [1.0, 2.0]  # the logged losses stay the training losses
    # The final merge picks by level (no held-out scoring then); without a score the vote falls back too.
    assert HDETController(config).decide(_interval(None, final=True)).winner == 0
    assert HDETController(config).decide(_interval(None)).winner == 0
    assert HDETController(config).decide(_interval([math.nan, 2.5])).winner == 0


# ------------------------------------------------------------------ four processes
class HeldoutLinear(LinearModel):
    """Least squares with a held-out loss and eight unshuffled validation batches of eight."""

    def heldout_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Regression(n=64, seed=1), batch_size=8)


class Params(Callback):
    """Each rank's parameters at train start and at every batch end, saved per rank (placed before or after the
    HDETCallback); rank 0 also saves the held-out losses the callback logged."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag, self.params = out, tag, {}

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.params[0] = flat_params(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.params[trainer.global_step] = flat_params(pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        hdet = next(cb for cb in trainer.callbacks if isinstance(cb, HDETCallback))
        heldout = {g: hdet.report.series(f"hdet/group{g}/heldout") for g in range(2)} if trainer.is_global_zero else {}
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": self.params, "heldout": heldout, "history": hdet.history},
                   self.out / f"{self.tag}{trainer.global_rank}.pt")


def _mse(flat: torch.Tensor, batches: int) -> float:
    """The mean over the first ``batches`` validation batches of the linear model ``flat`` = [w (8), b]'s MSE."""
    data = Regression(n=64, seed=1)
    losses = []
    for b in range(batches):
        x, y = data.x[8 * b: 8 * b + 8].double(), data.y[8 * b: 8 * b + 8].double()
        losses.append(float(((x @ flat[:8].reshape(8, 1) + flat[8] - y) ** 2).mean()))
    return sum(losses) / len(losses)


def test_groups_score_their_averaged_iterate_on_the_same_heldout_batches(tmp_path):
    """2 groups of 2 ranks; 3 held-out batches split over a group's ranks (2 + 1). At each vote a group's number
    is the MSE of the mean of its restart point and the iterates since, on batches 0-2; the vote follows it."""
    seed_everything(3)
    callback = HDETCallback(every_n_steps=4, vote=Best(blend="best"), signal=Heldout(batches=3), search=False)
    strategy = HDETStrategy(num_groups=2, spread=0.5, gradient_sync="group", start_method=START)
    trainer = Trainer(strategy=strategy, callbacks=[Params(tmp_path, "pre"), callback, Params(tmp_path, "post")],
                      **trainer_kwargs(devices=4, max_steps=8, limit_val_batches=2))
    trainer.fit(HeldoutLinear(lr=0.05))
    pre = [torch.load(tmp_path / f"pre{r}.pt", weights_only=False) for r in range(4)]
    post = [torch.load(tmp_path / f"post{r}.pt", weights_only=False) for r in range(4)]
    for vote, restart in ((4, 0), (8, 4)):
        expected = []
        for g, head in enumerate((0, 2)):
            start = pre[head]["params"][0] if restart == 0 else post[head]["params"][restart]
            iterates = [start] + [pre[head]["params"][s] for s in range(restart + 1, vote + 1)]
            assert torch.equal(pre[head]["params"][vote], pre[head + 1]["params"][vote])  # one model per group
            expected.append(_mse(torch.stack(iterates).mean(dim=0), 3))
        logged = [pre[0]["heldout"][g][1][pre[0]["heldout"][g][0].index(vote)] for g in range(2)]
        assert logged == pytest.approx(expected, rel=1e-5)
        winner = {row["winner"] for row in pre[0]["history"] if row["step"] == vote}
        assert winner == {min(range(2), key=lambda g: expected[g])}
