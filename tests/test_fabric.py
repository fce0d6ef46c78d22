"""Fabric strategies: ``Fabric(strategy="hdet")`` with HDETLoop, ``"async_local_sgd"`` / ``"diloco"``.

Two multi-process runs with Fabric's own launcher (fork, gloo on CPU) cover the collectives: groups at different
learning rates, a vote that rescues a diverged group through a merge, fabric.save of the merged model in the middle
of an interval, fabric.load, the final merge; and a DiLoCo loop over the exchange. The rest runs in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY

import lightning_hdet  # noqa: F401  (registers the names)
from lightning_hdet.fabric import AsyncLocalSGDFabricStrategy, HDETFabricStrategy, HDETLoop
from tests.helpers import START, Regression, flat_params

BASE_LR = 0.01


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = Regression(n=16 * steps, seed=rank)
    return [(data.x[16 * i : 16 * (i + 1)], data.y[16 * i : 16 * (i + 1)]) for i in range(steps)]


def _train(fabric: Fabric, model: Any, optimizer: Any, batches: list, hdet: Any = None) -> None:
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if hdet is not None:
            hdet.step(loss)


def _gathered(fabric: Fabric, model: Any) -> torch.Tensor:
    return fabric.all_gather(flat_params(model))  # (world_size, n)


def _hdet_run(fabric: Fabric, path: Path) -> None:
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    seen: list[float] = []  # the learning rate each optimizer step really used
    optimizer.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    hdet = HDETLoop(fabric, every_n_steps=4)
    strategy = fabric.strategy
    batches = _batches(fabric.global_rank, 12)
    _train(fabric, model, optimizer, batches[:4], hdet)  # group 1 at 100 x the LR diverges; the vote at step 4
    assert seen == pytest.approx([BASE_LR * (1.0, 100.0)[strategy.group_index]] * 4)
    assert [r["rescued"] for r in hdet.history] == [False, True], hdet.history
    gathered = _gathered(fabric, model)
    assert torch.equal(gathered[0], gathered[1]), "the rescued group took the healthy group's model"
    multipliers = strategy.lr_multipliers[:, 0].tolist()
    assert multipliers[0] == 1.0 and multipliers[1] < 100.0 * 0.6  # its LR was cut (x0.5 after PBT's x1.2 at most)
    _train(fabric, model, optimizer, batches[4:7], hdet)
    assert seen[4:] == pytest.approx([BASE_LR * multipliers[strategy.group_index]] * 3)
    gathered = _gathered(fabric, model)
    assert not torch.equal(gathered[0], gathered[1]), "the groups trained apart again"
    merged = gathered.mean(0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "hdet": hdet})  # mid-interval: the merged model
    if fabric.global_rank == 0:
        saved = torch.load(path, weights_only=False)
        assert torch.allclose(torch.cat([v.reshape(-1).double() for v in saved["model"].values()]), merged)
        assert saved["hdet"]["global_step"] == 7
    fabric.barrier()
    history = list(hdet.history)
    _train(fabric, model, optimizer, batches[7:8], hdet)
    fabric.load(path, {"model": model, "optimizer": optimizer, "hdet": hdet})
    assert torch.allclose(flat_params(model), merged), "every group takes the checkpoint's merged model"
    assert hdet.global_step == 7 and hdet.history == history
    assert strategy.lr_multipliers[:, 0].tolist() == multipliers
    _train(fabric, model, optimizer, batches[7:10], hdet)  # the vote at step 8, then two steps
    hdet.finish()
    assert len(hdet.history) == 3 * 2  # the rescue, the vote at 8 and the final vote, two groups each
    gathered = _gathered(fabric, model)
    assert torch.equal(gathered[0], gathered[1]), "finish() leaves every rank holding the merged model"


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=BASE_LR)


def test_hdet_fabric_loop_votes_rescues_saves_and_loads(tmp_path: Path) -> None:
    strategy = HDETFabricStrategy(lr_multipliers=[1.0, 100.0], gradient_sync="group", start_method=START)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_hdet_run, tmp_path / "hdet.ckpt")


def _search_run(fabric: Fabric) -> None:
    """The default loop: the search ends at a quarter of ``max_steps`` (the vote at step 2 of 8), and from the next
    step on every rank's gradient is the mean over all ranks (before, each group's own: its rank's own data)."""
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    # Unset, the interval is sized to max_steps as the Trainer's (two votes in the search): 80 steps vote every 10.
    assert [HDETLoop(fabric, max_steps=n).settings.every_n_steps for n in (80, 1000, None)] == [10, 100, 100]
    hdet = HDETLoop(fabric, every_n_steps=2, max_steps=8)
    same: list[bool] = []  # per step: every rank's averaged gradient is the same
    for x, y in _batches(fabric.global_rank, 8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        grads = fabric.all_gather(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        same.append(bool(torch.equal(grads[0], grads[1])))
        optimizer.step()
        optimizer.zero_grad()
        hdet.step(loss)
    hdet.finish()
    assert hdet.controller.searched_at == 2 and fabric.strategy.gradient_sync == "global"
    assert same == [False] * 2 + [True] * 6, same


def test_the_fabric_default_searches_then_averages_gradients_over_every_rank() -> None:
    """``Fabric(strategy="hdet")`` takes the Trainer's defaults (grid, gradient sync, vote, search) and, without
    wrapping the model again, ends the search as the Trainer does."""
    from lightning.pytorch import Trainer

    fabric = Fabric(accelerator="cpu", devices=2, strategy="hdet_fork")
    trainer = Trainer(strategy="hdet", accelerator="cpu", devices=2, logger=False)
    assert torch.equal(fabric.strategy.lr_multipliers, trainer.strategy.lr_multipliers)
    assert (fabric.strategy.gradient_sync, fabric.strategy.preset) == ("group", trainer.strategy.preset)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=HDETFabricStrategy(start_method=START))
    fabric.launch(_search_run)


def _cluster_run(fabric: Fabric) -> None:
    """The default grid of "cluster" on four ranks (0.19, 1, 1, 5.2): ranks 1 and 2 average one gradient, the probes
    their own, until the clusters split at step 3."""
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    shared, apart = [], []  # per step: ranks 1 and 2 / 0 and 1 saw the same averaged gradient
    for step, (x, y) in enumerate(_batches(fabric.global_rank, 6)):
        if step == 3:
            fabric.strategy.set_clusters([[0], [1], [2], [3]])
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        grads = fabric.all_gather(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        shared.append(bool(torch.equal(grads[1], grads[2])))
        apart.append(not torch.allclose(grads[0], grads[1]))
        optimizer.step()
        optimizer.zero_grad()
    assert shared == [True] * 3 + [False] * 3 and all(apart), (shared, apart)


def test_a_fabric_cluster_shares_one_gradient_until_it_splits() -> None:
    fabric = Fabric(accelerator="cpu", devices=4, strategy=HDETFabricStrategy(gradient_sync="cluster",
                                                                              start_method=START))
    fabric.launch(_cluster_run)


def _diloco_run(fabric: Fabric, path: Path) -> None:
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    start = flat_params(model)
    strategy, steps = fabric.strategy, 0
    with strategy.training(max_steps=4):  # 8 inner steps in all, rounds of 2
        for x, y in _batches(fabric.global_rank, 20):
            if strategy.should_stop:
                break
            _train(fabric, model, optimizer, [(x, y)])
            steps += 1
        outer_updates, rounds = strategy.outer_updates, strategy.rounds
    assert steps == 4 and [r[0] for r in rounds][:2] == [2, 2], rounds
    if fabric.global_rank == 0:
        assert outer_updates == 2, "DiLoCo: one outer step per round of both workers"
    gathered = _gathered(fabric, model)
    assert torch.equal(gathered[0], gathered[1]) and not torch.equal(gathered[0], start)
    fabric.save(path, {"model": model})
    if fabric.global_rank == 0:
        saved = torch.load(path, weights_only=True)["model"]
        assert torch.equal(torch.cat([v.reshape(-1).double() for v in saved.values()]), gathered[0])


def test_diloco_fabric_loop_trains_over_the_exchange(tmp_path: Path) -> None:
    strategy = AsyncLocalSGDFabricStrategy(mode="sync", local_steps=2, start_method=START)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_diloco_run, tmp_path / "diloco.ckpt")


def test_fabric_registry_knows_the_names() -> None:
    for name, cls in (("hdet", HDETFabricStrategy), ("hdet_fork", HDETFabricStrategy),
                      ("async_local_sgd", AsyncLocalSGDFabricStrategy), ("diloco_spawn", AsyncLocalSGDFabricStrategy)):
        assert STRATEGY_REGISTRY[name]["strategy"] is cls
    assert STRATEGY_REGISTRY["diloco"]["init_params"]["mode"] == "sync"
    fabric = Fabric(accelerator="cpu", devices=4, strategy="diloco")
    assert isinstance(fabric.strategy, AsyncLocalSGDFabricStrategy) and fabric.strategy.outer_settings.mode == "sync"
    assert Fabric(accelerator="cpu", devices=4, strategy="hdet").strategy.layout.num_groups == 4


def test_fabric_strategies_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="process_group"):
        HDETFabricStrategy(process_group=object())
    with pytest.raises(ValueError, match="lr_multipliers"):
        HDETFabricStrategy(num_groups=3, lr_multipliers=[1.0, 2.0])
    with pytest.raises(ValueError, match="local_steps"):
        AsyncLocalSGDFabricStrategy(local_steps=0)
    with pytest.raises(ValueError, match="compression"):
        AsyncLocalSGDFabricStrategy(compression="zip")
    with pytest.raises(TypeError, match="`transport='gloo'` is not a Transport"):
        AsyncLocalSGDFabricStrategy(transport="gloo")
    with pytest.raises(ValueError, match="at least 2 processes"):
        Fabric(accelerator="cpu", devices=1, strategy="async_local_sgd")
    with pytest.raises(TypeError, match="strategy='hdet'"):
        HDETLoop(Fabric(accelerator="cpu", devices=1))
    strategy = HDETFabricStrategy(gradient_sync="group")
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)  # not launched: the checks come first
    with pytest.raises(ValueError, match="fabric.setup"):
        HDETLoop(fabric)
    model = torch.nn.Linear(2, 1)
    strategy.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="monitor"):  # no validation loop: not an argument of HDETLoop
        HDETLoop(fabric, monitor="val_loss")
    with pytest.raises(ValueError, match="`max_steps` must be"):
        HDETLoop(fabric, max_steps=0)
    with pytest.raises(ValueError, match="every_n_steps"):
        HDETLoop(fabric, every_n_steps=0)
