"""Issue 15 as multi-process tests (gloo, fork): the defaults improve a model with a slowed worker, and compressed
pushes still do while sending fewer bytes."""

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hdet  # noqa: F401  (registers the strategies)
from lightning_hdet import AsyncLocalSGDStrategy, SlowRanks
from lightning_hdet.asynchronous.wire.codecs import Codec


class SGDBoring(BoringModel):
    """Lightning's BoringModel (a 32 -> 2 linear regression onto ones) with plain SGD, lr 0.05, as a new user
    would try it."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loss(model: torch.nn.Module) -> float:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(99))  # the same held-out inputs every time
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), torch.ones(len(x), 2)))


class Record(Callback):
    """Rank 0 writes the global model's loss and the per-worker bytes the outer side counted."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            stats = trainer.strategy.worker_stats()
            self.out.write_text(json.dumps({"loss": _loss(pl_module), "stats": stats}))


def _fit_issue_case(tmp_path: Path, strategy: AsyncLocalSGDStrategy) -> tuple[float, dict]:
    """The issue's case: 4 workers, rank 3 four times slower, H = 12, a 120-step budget; returns the initial loss
    and rank 0's record."""
    return _fit_four(tmp_path, strategy, SlowRanks({3: 4.0}, base_seconds=0.01))


def _fit_four(tmp_path: Path, strategy: AsyncLocalSGDStrategy, *callbacks: Callback) -> tuple[float, dict]:
    """120 steps of SGDBoring on 4 processes with these callbacks; returns the initial loss and rank 0's record."""
    seed_everything(0)
    model = SGDBoring()
    initial = _loss(model)
    out = tmp_path / "record.json"
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=4, max_steps=120, limit_val_batches=0,
                      num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, callbacks=[*callbacks, Record(out)])
    trainer.fit(model)
    return initial, json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_defaults_improve_the_model_with_a_slow_worker(tmp_path):
    """With the published outer settings (lr 0.7, momentum 0.9, no warm-up or restarts) this run ended worse than
    it started (loss 1.20 -> 1.40 to 3.7 in the sweep of docs/async.md); at the defaults it must end below."""
    initial, record = _fit_issue_case(tmp_path, AsyncLocalSGDStrategy(local_steps=12, start_method="fork"))
    # seen in the sweep at the chosen default: 0.01-0.03x the initial loss; asserted with a wide margin, since how
    # stale each push is depends on timing
    assert record["loss"] < 0.5 * initial


@pytest.mark.timeout(240)
def test_int8_pushes_and_bf16_pulls_improve_the_model_with_fewer_bytes(tmp_path):
    strategy = AsyncLocalSGDStrategy(local_steps=12, compression="int8", error_feedback=True, pull_compression="bf16",
                                     start_method="fork")
    initial, record = _fit_issue_case(tmp_path, strategy)
    assert record["loss"] < 0.5 * initial
    # BoringModel's parameters: a 2 x 32 weight (2 rows) and a bias of 2 (one chunk): 4 * 3 scale bytes + 66 values
    push = Codec("int8", [torch.Size([2, 32]), torch.Size([2])]).nbytes
    assert push == 78 < 4 * 66 / 3
    for stats in record["stats"].values():  # every round's push (and the final partial one) was one message
        assert stats["push_bytes"] == push * stats["rounds"]


@pytest.mark.timeout(240)
def test_int8_pushes_and_int8_delta_pulls_improve_the_model_with_fewer_bytes(tmp_path):
    """Async, so a reply may carry several changes (one per batch the server closed since the worker's last pull):
    a remote worker's first pull is the model itself (66 float32 values, 264 bytes), a later one the 78-byte int8
    changes it lacks, or the model again once they would weigh more (the log keeps 264 bytes: 3 changes; the slow
    worker misses more); rank 0's own pulls travel nowhere."""
    strategy = AsyncLocalSGDStrategy(local_steps=12, compression="int8", pull_compression="int8", start_method="fork")
    initial, record = _fit_issue_case(tmp_path, strategy)
    assert record["loss"] < 0.5 * initial
    change = Codec("int8", [torch.Size([2, 32]), torch.Size([2])]).nbytes
    assert record["stats"]["0"]["pull_bytes"] == record["stats"]["0"]["dense_pulls"] == 0
    changes = {}
    for worker in ("1", "2", "3"):
        stats = record["stats"][worker]
        changes[worker], rest = divmod(stats["pull_bytes"] - 264 * stats["dense_pulls"], change)
        assert stats["dense_pulls"] >= 1 and changes[worker] >= 0 and rest == 0
    assert sum(changes.values()) > 0


class RecordPulled(Callback):
    """Every rank writes the parameters it pulled last; rank 0 also whether its public model is the global one."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer, pl_module):
        exchange = trainer.strategy._exchange
        record = {"pulled": exchange.worker.pulled[: exchange.worker.n_params].tolist()}
        if trainer.global_rank == 0:
            record["public_is_global"] = torch.equal(exchange.server.public.params, exchange.outer.params)
        (self.out / f"pulled{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.timeout(240)
def test_sparseloco_with_sparse_pulls_improves_the_model_and_workers_hold_the_global_model(tmp_path):
    """DiLoCo with SparseLoCo's update, topk2 both ways: BoringModel's 66 values are one chunk, so each push sends
    one value (a 4-byte scale, a 2-byte position, a level byte: 7 bytes) and each change forwards the 3 others'
    (a 4-byte factor and 3 slots of 8 bytes: 28 bytes; the worker fills its own slot with its push); a remote
    worker's first pull is the model (264 bytes). Every worker's last pull is the same version, and the public
    model is the global one bit for bit."""
    strategy = AsyncLocalSGDStrategy(local_steps=12, mode="sync", outer="sparseloco", compression="topk2",
                                     pull_compression="topk2", start_method="fork")
    initial, record = _fit_four(tmp_path, strategy, RecordPulled(tmp_path))
    assert record["loss"] < 0.5 * initial  # 0.17x when written
    assert Codec("topk2", [torch.Size([2, 32]), torch.Size([2])]).nbytes == 7
    for worker, stats in record["stats"].items():
        assert stats["push_bytes"] == 7 * stats["rounds"]
        if worker != "0":  # the pulls after its hello: one change a round (the stop reply sends none)
            assert (stats["dense_pulls"], stats["pull_bytes"]) == (1, 264 + 28 * (stats["rounds"] - 1))
    pulled = [json.loads((tmp_path / f"pulled{rank}.json").read_text()) for rank in range(4)]
    assert pulled[0]["public_is_global"]
    assert all(p["pulled"] == pulled[0]["pulled"] for p in pulled)


def test_outer_presets_and_explicit_numbers_reach_the_outer_optimizer():
    tail = (1 - 0.9**9) / 0.1  # one push's whole echo at momentum 0.9 restarted every 8 updates: 6.126 x the push
    for mode in ("async", "sync"):  # one default in both modes: "stable", lr min((1 + 0.5) / (2 * 2), 1 / 1.996)
        config = AsyncLocalSGDStrategy(mode=mode).config
        assert (config["outer"], config["momentum_warmup"], config["momentum_restart"]) == (None, 16, 8)
        assert (config["outer_lr"], config["outer_momentum"]) == pytest.approx((0.375, 0.5))
    assert AsyncLocalSGDStrategy(outer_momentum=0.9).config["outer_lr"] == pytest.approx(1 / tail)  # lr follows beta
    assert AsyncLocalSGDStrategy(outer_momentum=0.9, momentum_restart=0).config["outer_lr"] == pytest.approx(0.1)
    published = AsyncLocalSGDStrategy(outer="published", outer_momentum=0.5)
    assert (published.config["outer_lr"], published.config["outer_momentum"], published.config["momentum_warmup"]) \
        == (0.7, 0.5, 0)
    optimizer = AsyncLocalSGDStrategy(momentum_restart=3).outer_settings.build(
        torch.zeros(2), torch.zeros(0), workers=4, budget=None).optimizer
    assert optimizer.defaults["momentum_restart"] == 3 and optimizer.defaults["momentum_warmup"] == 16


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(outer="fast"), r"`outer` must be one of \('stable', 'published', 'robust', 'sparseloco'\)"),
    (dict(momentum_warmup=-1), "`momentum_warmup` must be an integer >= 0, got -1"),
    (dict(momentum_restart=1.5), "`momentum_restart` must be an integer >= 0, got 1.5"),
    (dict(compression="fp8"), r"`compression` must be one of \('none', 'bf16', 'int8', 'topk2', 'topk4'\)"),
    (dict(compression="topk2", error_feedback=False), r"`error_feedback` must be True with compression='topk2'"),
    (dict(error_feedback="yes"), "`error_feedback` must be True or False"),
    (dict(pull_compression="fp8"),
     r"`pull_compression` must be one of \('none', 'bf16', 'int8', 'topk2', 'topk4'\).*only what changed"),
    (dict(mode="sync", compression="topk2", pull_compression="topk2"),
     r"`pull_compression` must be 'none', 'bf16' or 'int8' without outer='sparseloco', got 'topk2'.*fall behind"),
    (dict(mode="sync", outer="sparseloco", compression="topk2", pull_compression="topk4"),
     r"`pull_compression` must be compression='topk2' \(a pull forwards the round's pushes as they are\)"),
    (dict(outer="sparseloco", compression="topk2"), r"`outer='sparseloco'` applies only with mode='sync'"),
    (dict(mode="sync", outer="sparseloco", compression="int8"),
     r"`compression` must be 'topk2' or 'topk4' with outer='sparseloco', got 'int8'"),
    (dict(mode="sync", outer="sparseloco", compression="topk2", outer_momentum=0.9),
     r"`outer_momentum=0.9` has no effect with outer='sparseloco'"),
    (dict(mode="sync", outer="sparseloco", compression="topk2", error_decay=-0.1),
     r"`error_decay` must be a number in \[0, 1\], got -0.1"),
    (dict(mode="sync", compression="topk2", error_decay=0.9),
     r"`error_decay` must be None without outer='sparseloco', got 0.9"),
])
def test_bad_outer_and_compression_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncLocalSGDStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mode="sync", grace_period=0.0), r"`grace_period=0.0` has no effect with mode='sync' \(DiLoCo\)"),
    (dict(mode="sync", dynamic_local_steps=True), r"`dynamic_local_steps=True` has no effect with mode='sync'"),
    (dict(mode="sync", delayed_nesterov=False), r"`delayed_nesterov=False` has no effect with mode='sync'"),
    (dict(error_feedback=True), r"`error_feedback` must be left unset with compression='none', got True"),
])
def test_an_option_without_effect_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncLocalSGDStrategy(**kwargs)


def test_the_run_config_records_the_async_only_options_as_in_force_or_not():
    """Async fills their defaults; DiLoCo records them as not in force (None); error feedback follows the codec."""
    config = AsyncLocalSGDStrategy().config
    assert (config["delayed_nesterov"], config["dynamic_local_steps"], config["grace_period"]) == (True, True, 0.0)
    assert config["error_feedback"] is False
    config = AsyncLocalSGDStrategy(mode="sync", compression="int8").config
    assert (config["delayed_nesterov"], config["dynamic_local_steps"], config["grace_period"]) == (None, None, None)
    assert config["error_feedback"] is True
    assert AsyncLocalSGDStrategy(compression="bf16", error_feedback=False).config["error_feedback"] is False
