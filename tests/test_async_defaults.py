"""Issue 15 as multi-process tests (gloo, fork): the defaults improve a model with a slowed worker, and compressed
pushes still do while sending fewer bytes."""

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hdet  # noqa: F401  (registers the strategies)
from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy, DelayedNesterov, Nesterov, SlowRanks, SparseLoCo
from lightning_hdet.asynchronous.outer.momentum import stable_outer_lr
from lightning_hdet.asynchronous.wire.codecs import Int8, TopK


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
    initial, record = _fit_issue_case(tmp_path, AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(12), start_method="fork"))
    # seen in the sweep at the chosen default: 0.01-0.03x the initial loss; asserted with a wide margin, since how
    # stale each push is depends on timing
    assert record["loss"] < 0.5 * initial


@pytest.mark.timeout(240)
def test_int8_pushes_and_bf16_pulls_improve_the_model_with_fewer_bytes(tmp_path):
    strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(12), compression="int8", error_feedback=True, pull_compression="bf16",
                                     start_method="fork")
    initial, record = _fit_issue_case(tmp_path, strategy)
    assert record["loss"] < 0.5 * initial
    # BoringModel's parameters: a 2 x 32 weight (2 rows) and a bias of 2 (one chunk): 4 * 3 scale bytes + 66 values
    push = Int8().bind([torch.Size([2, 32]), torch.Size([2])]).nbytes
    assert push == 78 < 4 * 66 / 3
    for stats in record["stats"].values():  # every round's push (and the final partial one) was one message
        assert stats["push_bytes"] == push * stats["rounds"]


@pytest.mark.timeout(240)
def test_int8_pushes_and_int8_delta_pulls_improve_the_model_with_fewer_bytes(tmp_path):
    """Async, so a reply may carry several changes (one per batch the server closed since the worker's last pull):
    a remote worker's first pull is the model itself (66 float32 values, 264 bytes), a later one the 78-byte int8
    changes it lacks, or the model again once they would weigh more (the log keeps 264 bytes: 3 changes; the slow
    worker misses more); rank 0's own pulls travel nowhere."""
    strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(12), compression="int8", pull_compression="int8", start_method="fork")
    initial, record = _fit_issue_case(tmp_path, strategy)
    assert record["loss"] < 0.5 * initial
    change = Int8().bind([torch.Size([2, 32]), torch.Size([2])]).nbytes
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
    assert TopK(bits=2).bind([torch.Size([2, 32]), torch.Size([2])]).nbytes == 7
    for worker, stats in record["stats"].items():
        assert stats["push_bytes"] == 7 * stats["rounds"]
        if worker != "0":  # the pulls after its hello: one change a round (the stop reply sends none)
            assert (stats["dense_pulls"], stats["pull_bytes"]) == (1, 264 + 28 * (stats["rounds"] - 1))
    pulled = [json.loads((tmp_path / f"pulled{rank}.json").read_text()) for rank in range(4)]
    assert pulled[0]["public_is_global"]
    assert all(p["pulled"] == pulled[0]["pulled"] for p in pulled)


def test_outer_presets_and_objects_reach_the_outer_optimizer_with_every_number():
    tail = (1 - 0.9**9) / 0.1  # one push's whole echo at momentum 0.9 restarted every 8 updates: 6.126 x the push
    for mode in ("async", "sync"):  # one default in both modes: "stable", lr min((1 + 0.5) / (2 * 2), 1 / 1.996)
        config = AsyncLocalSGDStrategy(mode=mode).config
        assert (config["outer"], config["outer/warmup"], config["outer/restarts"]) == ("DelayedNesterov", 16, 8)
        assert (config["outer/lr"], config["outer/momentum"]) == pytest.approx((0.375, 0.5))
    assert stable_outer_lr(0.9, 8) == pytest.approx(1 / tail)  # the lr that follows momentum 0.9 (the default before)
    # what a user writes is what runs: no warm-up, no restarts unless given
    config = AsyncLocalSGDStrategy(outer=DelayedNesterov(lr=0.7, momentum=0.9)).config
    assert [config[f"outer/{k}"] for k in ("lr", "momentum", "warmup", "restarts", "buffer_size")] == [0.7, 0.9, 0, 0,
                                                                                                        None]
    optimizer = AsyncLocalSGDStrategy(outer=DelayedNesterov(lr=0.2, restarts=3)).outer_settings.build(
        torch.zeros(2), torch.zeros(0), workers=4, budget=None).optimizer
    assert optimizer.defaults["momentum_restart"] == 3 and optimizer.defaults["momentum_warmup"] == 0
    assert optimizer.defaults["buffer_size"] == 4 and optimizer.defaults["lr"] == 0.2
    sync = AsyncLocalSGDStrategy(mode="sync", outer=Nesterov(lr=0.7)).outer_settings.build(
        torch.zeros(2), torch.zeros(0), workers=4, budget=None).optimizer
    assert sync.defaults["buffer_size"] == 1 and sync.defaults["momentum"] == 0.9


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(outer="fast"), r"`outer` must be one of \('stable', 'published', 'robust', 'sparseloco'\)"),
    (dict(outer_lr=0.7), r"AsyncLocalSGDStrategy no longer takes `outer_lr`=0.7.* outer=DelayedNesterov\(lr=...\)"),
    (dict(momentum_warmup=4), r"no longer takes `momentum_warmup`=4.* outer=DelayedNesterov\(lr=..., warmup=...\)"),
    (dict(error_decay=0.9), r"no longer takes `error_decay`=0.9.* outer=SparseLoCo\(error_decay=...\)"),
    (dict(delayed_nesterov=False), r"no longer takes `delayed_nesterov`=False.* outer=Nesterov\(lr=..., momentum"),
    (dict(compression="fp8"), r"`compression` must be one of \('none', 'bf16', 'int8', 'topk2', 'topk4'\)"),
    (dict(compression="topk2", error_feedback=False), r"`error_feedback` must be True with compression=TopK\("),
    (dict(error_feedback="yes"), "`error_feedback` must be True or False"),
    (dict(pull_compression="fp8"), r"`pull_compression` must be one of \('none', 'bf16', 'int8', 'topk2', 'topk4'\)"),
    (dict(mode="sync", compression="topk2", pull_compression="topk2"),
     r"`pull_compression` must be NoCodec\(\), BF16\(\) or Int8\(\) without SparseLoCo, got TopK.*fall behind"),
    (dict(mode="sync", outer="sparseloco", compression="topk2", pull_compression="topk4"),
     r"`pull_compression` must be compression=TopK\(fraction=0.015625, bits=2\) \(a pull forwards the round's"),
    (dict(outer="sparseloco", compression="topk2"), r"`mode` must be 'sync' \(DiLoCo\) with SparseLoCo, got 'async'"),
    (dict(mode="sync", outer="sparseloco", compression="int8"),
     r"`compression` must be a TopK codec \('topk2' or 'topk4'\) with SparseLoCo, got Int8\(chunk=256\)"),
])
def test_bad_outer_and_compression_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncLocalSGDStrategy(**kwargs)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: DelayedNesterov(lr=0.7, warmup=-1), "`warmup` must be an integer >= 0, got -1"),
    (lambda: DelayedNesterov(lr=0.7, restarts=1.5), "`restarts` must be an integer >= 0, got 1.5"),
    (lambda: DelayedNesterov(lr=float("inf")), "`lr` must be a finite number, got inf"),
    (lambda: DelayedNesterov(lr=0.7, buffer_size=0), "`buffer_size` must be a positive integer or None, got 0"),
    (lambda: Nesterov(lr=0.7, momentum=1.0), r"`momentum` must be a number in \[0, 1\), got 1.0"),
    (lambda: SparseLoCo(error_decay=-0.1), r"`error_decay` must be a number in \[0, 1\], got -0.1"),
    (lambda: DelayedNesterov(0.7, momentm=0.5), "DelayedNesterov got an unsupported argument `momentm`=0.5. Did you"
                                                " mean `momentum`?"),
])
def test_outer_optimizer_options_are_checked_on_creation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mode="sync", local_steps=AdaptiveSteps(8)), r"`local_steps` must be an integer H with mode='sync' \(DiLoCo\)"
                                                       r".* Write local_steps=8"),
    (dict(grace_period=0.0), r"no longer takes `grace_period`=0.0.* local_steps=AdaptiveSteps\(start=H, grace_period"),
    (dict(dynamic_local_steps=False), r"no longer takes `dynamic_local_steps`=False.*AdaptiveSteps\(start=H\) \(True"
                                      r".* or local_steps=H \(False\)"),
    (dict(mode="sync", outer=DelayedNesterov(lr=0.7, buffer_size=2)),
     r"`buffer_size` must be None \(the default\) with mode='sync' \(DiLoCo\), got 2"),
    (dict(error_feedback=True), r"`error_feedback` must be left unset with compression=NoCodec\(\), got True"),
])
def test_an_option_without_effect_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AsyncLocalSGDStrategy(**kwargs)


def test_the_run_config_records_the_async_only_options_as_in_force_or_not():
    """Async: AdaptiveSteps (the default) records its numbers, an integer H fixed rounds and nothing more; DiLoCo
    records fixed rounds; error feedback follows the codec."""
    config = AsyncLocalSGDStrategy().config
    assert (config["local_steps"], config["local_steps/adaptive"], config["local_steps/min"]) == (50, True, 1)
    assert (config["local_steps/grace_period"], config["local_steps/smoothing"]) == (0.0, 0.5)
    config = AsyncLocalSGDStrategy(local_steps=20).config
    assert (config["local_steps"], config["local_steps/adaptive"]) == (20, False)
    assert [k for k in config if k.startswith("local_steps")] == ["local_steps", "local_steps/adaptive"]
    assert config["error_feedback"] is False and config["compression"] == "NoCodec"
    config = AsyncLocalSGDStrategy(mode="sync", compression="int8").config
    assert config["local_steps"] == 50 and [k for k in config if k.startswith("local_steps/")] == ["local_steps/adaptive"]
    assert config["local_steps/adaptive"] is False
    assert (config["compression"], config["compression/chunk"]) == ("Int8", 256)
    assert config["error_feedback"] is True
    assert AsyncLocalSGDStrategy(compression="bf16", error_feedback=False).config["error_feedback"] is False
