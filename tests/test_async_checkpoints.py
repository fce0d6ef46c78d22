"""Every checkpoint of the async strategy is whole: the best (top-k), last and periodic ones each carry every worker's
own inner state, as of that worker's exchange the checkpoint's global model includes; a resume from each kind gives
every worker its own back. Two processes on gloo through Lightning's own launcher, with Lightning's BoringModel."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_hdet import AsyncLocalSGDStrategy, SlowRanks
from tests.helpers import START, load_ranks, trainer_kwargs


class AdamBoring(BoringModel):
    """Lightning's BoringModel with Adam (an inner state to save) and a logged ``val_loss`` to monitor."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=4)


class ExchangeStates(Callback):
    """Each worker records its inner optimizer state when training starts (after a resume: what it loaded) and right
    after each of its exchanges (by how many it pushed then); written to ``out/rank{r}.pt`` at the end of fit."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.after: dict[int, Any] = {}

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The first step end that counts exchange k is the step of that exchange: its state is the one right after
        # it. (Keyed by the count, not by `steps_in_round == 0`: the exchange whose reply says stop, at the last
        # step, need not start a new round, and async runs hit it at a varying step.) A step can hold two exchanges
        # (the push whose reply says stop, then the leaving push, nothing trained between): every count not seen
        # yet up to this one is of this state.
        self._record(trainer.strategy._exchange.worker.exchanges, trainer.optimizers[0].state_dict())

    def _record(self, upto: int, state: dict[str, Any]) -> None:
        for count in range(max(self.after, default=0) + 1, upto + 1):
            self.after[count] = copy.deepcopy(state)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        worker = trainer.strategy._exchange.worker
        state = trainer.optimizers[0].state_dict()
        # An exchange at the very last step (its reply said stop) is seen by no step end: its state is this one, as
        # is that of the push a worker makes when leaving (how the run ends depends on timing under load).
        self._record(worker.exchanges + 1, state)
        torch.save({"start": self.start, "after": self.after}, self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, mode: str, ckpt_path: str | None = None, max_steps: int = 24) -> tuple[list[dict[str, Any]], Path]:
    seed_everything(0)
    out.mkdir(parents=True)
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode=mode, start_method=START)
    best = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=2, save_last=True)
    periodic = ModelCheckpoint(dirpath=out / "periodic", every_n_train_steps=6, save_top_k=-1)
    trainer = Trainer(strategy=strategy,
                      callbacks=[best, periodic, SlowRanks({}, base_seconds=0.01), ExchangeStates(out)],
                      **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=True, default_root_dir=out,
                                       limit_val_batches=2, val_check_interval=5, num_sanity_val_steps=0))
    trainer.fit(AdamBoring(), ckpt_path=ckpt_path)
    return load_ranks(out, 2), out


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    torch.testing.assert_close(a["state"], b["state"], rtol=0, atol=0)
    assert a["param_groups"] == b["param_groups"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_best_last_and_periodic_checkpoints_hold_every_workers_state(tmp_path: Path, mode: str) -> None:
    ranks, out = _fit(tmp_path / "a", mode)
    checkpoints = sorted((out / "ckpt").glob("*.ckpt")) + sorted((out / "periodic").glob("*.ckpt"))
    names = {p.name for p in checkpoints}
    assert "last.ckpt" in names and len([n for n in names if n.startswith("epoch=")]) >= 3  # 2 best + periodic
    for path in checkpoints:
        saved = torch.load(path, weights_only=True)["async_local_sgd"]
        for w in (0, 1):
            own = Path(f"{path}.worker{w}.pt")
            assert own.exists(), f"{own.name} is missing"
            # its state right after the exchange whose push the checkpoint's global model holds last
            _same(torch.load(own, weights_only=True)["optimizer"], ranks[w]["after"][saved["exchanges"][w]])
    assert not list(out.glob("**/*.worker*.pt")) or all(  # no worker file outlives its checkpoint
        Path(str(p).rsplit(".worker", 1)[0]).exists() for p in out.glob("**/*.worker*.pt"))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resume_from_the_best_last_or_a_periodic_checkpoint_gives_each_worker_its_own(tmp_path: Path,
                                                                                        mode: str) -> None:
    _, out = _fit(tmp_path / "a", mode)
    best = min((out / "ckpt").glob("epoch=*.ckpt"), key=lambda p: p.stat().st_mtime)
    periodic = sorted((out / "periodic").glob("*.ckpt"))[0]
    for i, path in enumerate((best, out / "ckpt" / "last.ckpt", periodic)):
        resumed, _ = _fit(tmp_path / f"r{i}", mode, ckpt_path=str(path), max_steps=32)
        for w in (0, 1):
            _same(resumed[w]["start"], torch.load(f"{path}.worker{w}.pt", weights_only=True)["optimizer"])
        assert not torch.equal(resumed[0]["start"]["state"][0]["exp_avg"], resumed[1]["start"]["state"][0]["exp_avg"])


class SaveAtStep(Callback):
    """A ``trainer.save_checkpoint`` of the user's own, on every rank, at its step ``step`` (mid-round)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


@pytest.mark.timeout(300)
def test_a_checkpoint_whose_workers_states_were_not_kept_says_so_and_resumes_from_rank_0s(tmp_path: Path) -> None:
    """DiLoCo, H = 4, no checkpoint callback (so no worker keeps its state after each exchange): a checkpoint of the
    user's own at step 6 holds the global model after round 1, but each worker's state as of that round's end is no
    longer held (worker 1 hears of the checkpoint at the end of round 2). Each worker's file says so, and a resume
    starts the workers from rank 0's inner state in the checkpoint."""
    seed_everything(0)
    path = tmp_path / "mine.ckpt"
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode="sync", start_method=START)
    trainer = Trainer(strategy=strategy, callbacks=[SaveAtStep(path, 6)], **trainer_kwargs(devices=2, max_steps=12))
    trainer.fit(AdamBoring())
    assert torch.load(path, weights_only=True)["async_local_sgd"]["exchanges"] == {0: 2, 1: 2}  # hello, round 1
    for w in (0, 1):
        own = torch.load(f"{path}.worker{w}.pt", weights_only=True)
        assert list(own) == ["missing"]
        assert "exchange 2" in own["missing"] and "no checkpoint callback" in own["missing"]
    out = tmp_path / "resumed"
    out.mkdir()
    resumed = Trainer(strategy=AsyncLocalSGDStrategy(local_steps=4, mode="sync", start_method=START),
                      callbacks=[ExchangeStates(out)], **trainer_kwargs(devices=2, max_steps=16))
    resumed.fit(AdamBoring(), ckpt_path=str(path))
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]  # rank 0's, at its step 6
    for rank in load_ranks(out, 2):
        _same(rank["start"], saved)


class SlowValidation(AdamBoring):
    """Rank 0's validation takes 0.05 s a batch on fixed data, long enough for worker 1 to push several times."""

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(16, 32, generator=torch.Generator().manual_seed(1)), batch_size=4)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(0.05)
        super().validation_step(batch, batch_idx)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner_states", [False, True])
def test_an_async_monitored_checkpoint_holds_the_model_its_score_measured(tmp_path: Path, inner_states: bool) -> None:
    """Async: the other worker pushes while rank 0 validates. Each checkpoint written at a validation's end holds the
    global model that validation scored (its recorded score recomputes from the saved weights), and every worker's
    own state as of the exchanges that model holds (in its file; or, ``checkpoint_inner_states``, the one its
    exchange sent)."""
    seed_everything(0)
    out = tmp_path / "a"
    out.mkdir()
    best = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=-1)
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode="async", start_method=START,
                                     checkpoint_inner_states=inner_states, compression="none")
    trainer = Trainer(strategy=strategy,
                      callbacks=[best, SlowRanks({}, base_seconds=0.01), ExchangeStates(out)],
                      **trainer_kwargs(devices=2, max_steps=40, enable_checkpointing=True, default_root_dir=out,
                                       limit_val_batches=4, val_check_interval=8, num_sanity_val_steps=0))
    trainer.fit(SlowValidation())
    ranks = load_ranks(out, 2)
    data = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    checkpoints = sorted((out / "ckpt").glob("*.ckpt"))
    assert len(checkpoints) >= 3
    for path in checkpoints:
        saved = torch.load(path, weights_only=False)
        score = next(s["current_score"] for k, s in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
        model = SlowValidation()
        model.load_state_dict(saved["state_dict"])
        with torch.no_grad():
            loss = torch.stack([model.step(data[i : i + 4]) for i in range(0, 16, 4)]).mean()
        torch.testing.assert_close(loss, score.float(), rtol=1e-6, atol=1e-6, msg=f"{path.name}: not the model scored")
        outer = saved["async_local_sgd"]
        for w in (0, 1):
            own = (outer["inner_optimizer_states"][w] if inner_states
                   else torch.load(f"{path}.worker{w}.pt", weights_only=True)["optimizer"])
            _same(own, ranks[w]["after"][outer["exchanges"][w]])
