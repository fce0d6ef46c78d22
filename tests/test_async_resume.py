"""Resuming the async strategy: synchronous DiLoCo resumes exactly; asynchronous runs land within tolerance."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy, SlowRanks
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from tests.helpers import LinearModel, Recorder, Regression, START, load_ranks, trainer_kwargs
from tests.versions import NEEDS_RANK_ZERO_CHECKPOINT_NAMES

# Documented in docs/failure_modes.md: an asynchronous run resumed from a checkpoint ends within this relative
# distance of an uninterrupted run's final loss (the order of pushes differs, so it cannot be bit-exact).
ASYNC_RESUME_RTOL = 0.25


def _fit(out: Path, mode: str, max_steps: int, ckpt_path: str | None = None) -> list[dict[str, Any]]:
    seed_everything(0)
    # One batch, the same on every rank and every step: Lightning's data order on resume is not under test.
    model = LinearModel(lr=0.05, n_train=16)
    strategy = AsyncLocalSGDStrategy(local_steps=2, mode=mode, start_method=START,
                                     outer=DelayedNesterov(lr=1.0, momentum=0.5, warmup=16, restarts=8))
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=4)
    trainer = Trainer(strategy=strategy, callbacks=[ckpt, Recorder(out)],
                      **trainer_kwargs(devices=2, max_steps=max_steps, enable_checkpointing=True,
                                       use_distributed_sampler=False))
    trainer.fit(model, ckpt_path=ckpt_path)
    return load_ranks(out, 2)


def _loss(params: torch.Tensor) -> float:
    data = Regression(n=16)
    return float(torch.nn.functional.mse_loss(data.x @ params[:8, None].float() + params[8].float(), data.y))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_matches_an_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    straight = _fit(tmp_path / "a", mode, 16)
    _fit(tmp_path / "b", mode, 8)
    resumed = _fit(tmp_path / "c", mode, 16, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    a, c = straight[0]["final_params"], resumed[0]["final_params"]
    assert all(torch.equal(r["final_params"], c) for r in resumed)  # every rank holds the global model
    if mode == "sync":
        torch.testing.assert_close(c, a, rtol=0, atol=1e-6)
    else:
        assert _loss(c) == pytest.approx(_loss(a), rel=ASYNC_RESUME_RTOL)
    assert _loss(c) < _loss(torch.zeros_like(c))  # and it trained


class InnerStates(Callback):
    """Each worker records its inner optimizer state when training starts (after a resume: what it loaded), right
    after each of its exchanges (keyed by its inner step count then), after each step (keyed by its step), its
    error-feedback residual at its first step, and its state at the end of fit; every rank then saves the
    end-of-fit checkpoint ``end.ckpt`` (rank 0 the file, each worker its own beside it). Written to
    ``out/rank{r}.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def _state(self, trainer: Trainer) -> dict[str, Any]:
        return copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.start = self._state(trainer)
        self.after_exchange = {0: self.start}  # the first exchange (before any step) sends the start state
        self.at_step: dict[int, Any] = {}
        self.residual = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.residual is None:  # the worker exists now (the strategy's on_train_start runs after callbacks')
            self.residual = trainer.strategy._exchange.worker.feedback.residual.clone()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        strategy = trainer.strategy
        self.at_step[trainer.global_step] = self._state(trainer)
        if strategy._exchange.worker.steps_in_round == 0:  # this step ended with an exchange
            self.after_exchange[strategy.inner_steps] = self._state(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: Any) -> None:
        trainer.save_checkpoint(self.out / "end.ckpt")
        torch.save({"start": self.start, "after_exchange": self.after_exchange, "at_step": self.at_step,
                    "residual": self.residual, "end": self._state(trainer)},
                   self.out / f"rank{trainer.global_rank}.pt")


def _assert_same_inner_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    torch.testing.assert_close(a["state"], b["state"], rtol=0, atol=0)
    assert a["param_groups"] == b["param_groups"]


def _fit_adam(out: Path, checkpoint_inner_states: bool, ckpt_path: str | None = None) -> list[dict[str, Any]]:
    seed_everything(0)
    out.mkdir(parents=True)
    # without inner states on the wire, the pushes are int8 so that each worker also has a residual to save
    strategy = AsyncLocalSGDStrategy(local_steps=2, start_method="fork",
                                     checkpoint_inner_states=checkpoint_inner_states,
                                     compression="none" if checkpoint_inner_states else "int8")
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=3, save_top_k=-1)
    # Each worker trains on its own shard, so the workers' Adam states differ; steps are paced to 20 ms so that
    # neither worker runs far ahead of the other.
    trainer = Trainer(strategy=strategy, callbacks=[ckpt, SlowRanks({}, base_seconds=0.02), InnerStates(out)],
                      **trainer_kwargs(devices=2, max_steps=16, enable_checkpointing=True, default_root_dir=out))
    trainer.fit(LinearModel(optimizer="adam", n_train=64, batch_size=8), ckpt_path=ckpt_path)
    return load_ranks(out, 2)


@pytest.mark.timeout(240)
def test_pushed_inner_states_hold_every_workers_state_as_of_its_exchange(tmp_path: Path) -> None:
    """With `checkpoint_inner_states=True` every checkpoint written during training holds each worker's inner
    optimizer state as of its latest exchange (sent to rank 0 with its pushes), and each worker resumes its own."""
    ranks = _fit_adam(tmp_path / "a", True)
    saved = {path: torch.load(path, weights_only=True)["async_local_sgd"]
             for path in (tmp_path / "a" / "ckpt").glob("*.ckpt")}
    assert len(saved) >= 3
    both_pushed = []
    for path, state in saved.items():
        inner, workers = state["inner_optimizer_states"], state["workers"]
        assert set(inner) == set(workers)  # every worker that has joined
        for w, inner_state in inner.items():
            _assert_same_inner_state(inner_state, ranks[w]["after_exchange"][workers[w]["steps"]])
        if len(workers) == 2 and all(s["steps"] > 0 for s in workers.values()):
            both_pushed.append(path)
            assert not torch.allclose(inner[0]["state"][0]["exp_avg"], inner[1]["state"][0]["exp_avg"])
    assert both_pushed
    # resume from a mid-training checkpoint (the earliest in which both workers have pushed)
    path = min(both_pushed, key=lambda p: saved[p]["steps_done"])
    resumed = _fit_adam(tmp_path / "b", True, ckpt_path=str(path))
    for w in (0, 1):
        _assert_same_inner_state(resumed[w]["start"], saved[path]["inner_optimizer_states"][w])  # its own


@NEEDS_RANK_ZERO_CHECKPOINT_NAMES
@pytest.mark.timeout(240)
def test_each_worker_checkpoints_its_own_inner_state_and_residual(tmp_path: Path) -> None:
    """By default nothing but pseudo-gradients travels: rank 0's checkpoints hold no inner states, and every
    worker writes its own inner optimizer state and error-feedback residual beside each checkpoint rank 0 wrote
    (its state as of its latest exchange that the checkpoint's global model holds), which it alone loads on
    resume."""
    ranks = _fit_adam(tmp_path / "a", False)
    paths = sorted((tmp_path / "a" / "ckpt").glob("*.ckpt"))
    assert len(paths) >= 3
    for path in paths:
        saved = torch.load(path, weights_only=True)["async_local_sgd"]
        assert saved["inner_optimizer_states"] == {}
        for w in (0, 1):
            own = torch.load(f"{path}.worker{w}.pt", weights_only=True)
            steps = saved["workers"][w]["steps"] if w in saved["workers"] else 0  # of its pushes the model holds
            _assert_same_inner_state(own["optimizer"], ranks[w]["after_exchange"][steps])
    # the end-of-fit checkpoint: every worker's final state, in its own file
    for w in (0, 1):
        _assert_same_inner_state(torch.load(tmp_path / "a" / f"end.ckpt.worker{w}.pt", weights_only=True)["optimizer"],
                                 ranks[w]["end"])
    # resume from a mid-training checkpoint whose global model holds a push of each worker: each worker its own
    # state and residual
    path = next(p for p in paths if all(torch.load(p, weights_only=True)["async_local_sgd"]["workers"].get(w, {})
                                        .get("steps", 0) > 0 for w in (0, 1)))
    resumed = _fit_adam(tmp_path / "b", False, ckpt_path=str(path))
    for w in (0, 1):
        own = torch.load(f"{path}.worker{w}.pt", weights_only=True)
        _assert_same_inner_state(resumed[w]["start"], own["optimizer"])
        residual = own["error_feedback"]["residual"]
        assert residual.abs().sum() > 0  # int8 lost something, kept for the next push
        torch.testing.assert_close(resumed[w]["residual"], residual, rtol=0, atol=0)
    assert not torch.equal(resumed[0]["start"]["state"][0]["exp_avg"], resumed[1]["start"]["state"][0]["exp_avg"])
    assert bool(torch.isfinite(resumed[0]["end"]["state"][0]["exp_avg"]).all())


def test_a_checkpoint_takes_one_snapshot_of_the_outer_state(tmp_path: Path) -> None:
    """A push applied between ``lightning_module_state_dict`` and ``save_checkpoint`` (rank 0, during training)
    changes neither: the checkpoint's model and its outer state are the same snapshot."""
    from lightning_hdet._tensors import numel
    from lightning_hdet.asynchronous.exchange.exchange import Exchange
    from lightning_hdet.asynchronous.exchange.worker import Worker
    from lightning_hdet.asynchronous.wire.messages import Kind, Push

    model = LinearModel(lr=0.05, n_train=16)
    strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(2), outer=DelayedNesterov(lr=1.0, momentum=0.0), start_method=START)
    strategy.connect(model)
    exchange = Exchange.__new__(Exchange)  # rank 0's part without process groups: its outer state and module
    exchange.module, exchange.device = model, torch.device("cpu")
    exchange.outer = Exchange.start_outer(strategy.outer_settings, model, exchange.device, 2, None, None)
    exchange.worker = Worker(model, exchange.device, transport=None)  # type: ignore[arg-type]  # training: no stop
    strategy._exchange, strategy.training_apart = exchange, True  # rank 0 while training: pushes keep arriving
    own = [p.detach().clone() for p in model.parameters()]
    state_dict = strategy.lightning_module_state_dict()
    n = numel(list(model.parameters()))
    push = Push(1, Kind.PUSH, 2, 1.0, 0.0, pseudo_gradient=torch.ones(n))
    exchange.outer.process([Push(1, Kind.HELLO, 0, 0.0, 0.0)])
    exchange.outer.process([push])  # the push lands between the two calls
    strategy.save_checkpoint({"state_dict": state_dict}, tmp_path / "c.ckpt")
    saved = torch.load(tmp_path / "c.ckpt", weights_only=True)
    flat = torch.cat([saved["state_dict"][k].flatten() for k, _ in model.named_parameters()])
    torch.testing.assert_close(flat, saved["async_local_sgd"]["params"])
    assert not torch.equal(flat, exchange.outer.params)  # the push did land, after the snapshot
    for mine, p in zip(own, model.parameters()):  # the module holds its own parameters again
        torch.testing.assert_close(mine, p.detach())
