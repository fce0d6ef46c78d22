"""FSDP2 inside workers of several ranks (``inside_worker="fsdp"``): the refused combinations in one process, and 4
processes as 2 workers x 2 ranks through Lightning's Trainer (gloo, fork), DiLoCo and async, against the same runs
with DDP inside; checkpoints resumed with another number of ranks per worker (4 <-> 6 processes)."""

import copy
import time
import types
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightning_hdet  # noqa: F401  (registers the strategies)
from lightning_hdet import AsyncLocalSGDStrategy, WorkerShape
from lightning_hdet._tensors import flat_pieces
from lightning_hdet.asynchronous.exchange.ranks import WorkerRanks
from lightning_hdet.asynchronous.exchange.reshard import shard_rows
from lightning_hdet.asynchronous.exchange.worker_shards import full_pieces, local_state, rows
from lightning_hdet.asynchronous.lightning.checkpoints import WorkerCheckpoints, worker_file
from lightning_hdet.asynchronous.wire.messages import Fragments
from tests.helpers import START, async_strategy, load_ranks
from tests.test_async_local_sgd import Regression
from tests.test_async_ranks import _held_bytes


class MLP(LightningModule):
    """Regression through 8 -> 5 -> 1 with AdamW: 5 rows split 3 + 2 over a worker's 2 ranks, 1 row 1 + 0 (an empty
    shard), so that uneven FSDP2 shards are exchanged too."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
        self.data = Regression().data
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def on_validation_end(self):
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)


class SlowValidation(MLP):
    """The MLP whose validation takes long enough for worker 1 to push meanwhile."""

    def validation_step(self, batch, batch_idx):
        time.sleep(0.005)
        super().validation_step(batch, batch_idx)


def _val_loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logged ``val_loss`` of ``params``: the mean over the validation batches."""
    model = MLP()
    model.load_state_dict(params)
    with torch.no_grad():
        return torch.stack([nn.functional.mse_loss(model.net(x), y) for x, y in model.val_dataloader()]).mean()


def _mse(params: dict[str, torch.Tensor]) -> float:
    model = MLP()
    model.load_state_dict(params)
    x, y = model.data.tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model.net(x), y))


class _Record(Callback):
    """Each rank writes, at the end of fit, its part of the final model (its shards, or the whole module), its
    inner optimizer state at the start and end of training, and saves a checkpoint at the end of training."""

    def __init__(self, out: Path, save: bool) -> None:
        self.out, self.save = out, save

    def on_train_start(self, trainer, pl_module):
        self.start = copy.deepcopy(local_state(trainer.optimizers[0].state_dict()))

    def on_train_end(self, trainer, pl_module):
        if self.save:
            trainer.save_checkpoint(self.out / "end.ckpt")
        self.end = copy.deepcopy(local_state(trainer.optimizers[0].state_dict()))

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy
        torch.save({"model": local_state(pl_module.state_dict()), "start": self.start, "end": self.end,
                    "inner_steps": s.inner_steps, "rounds": s.rounds, "val_losses": pl_module.val_losses,
                    "held": _held_bytes(s._exchange, pl_module, trainer.optimizers[0]),
                    "outer": s._outer.state_dict() if s._outer is not None else None},
                   self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, mode: str, inside: str, max_steps: int = 40, save: bool = False, ckpt_path=None, devices: int = 4,
         ranks_per_worker: int = 2, best: bool = False, **kwargs):
    out.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    worker = WorkerShape(ranks_per_worker=ranks_per_worker, inside_worker=inside,
                         auto_wrap_policy=kwargs.pop("auto_wrap_policy", None))
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode=mode, start_method=START, worker=worker,
                                     **kwargs)
    checkpoints = [ModelCheckpoint(dirpath=out / "best", monitor="val_loss", save_top_k=-1)] if best else []
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, default_root_dir=out, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=best,
                      max_steps=max_steps, val_check_interval=10, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      callbacks=[_Record(out, save), *checkpoints])
    model = SlowValidation() if best else MLP()
    trainer.fit(model, ckpt_path=ckpt_path)
    ranks = load_ranks(out, devices)
    ranks[0]["handed_back"] = model.state_dict()  # what the fork launcher gave the main process
    return ranks


def _full(ranks: list[dict], worker: int = 0) -> dict[str, torch.Tensor]:
    """The final model of ``worker``'s ranks, its shards put back together (dim 0)."""
    first, second = ranks[2 * worker]["model"], ranks[2 * worker + 1]["model"]
    return {k: torch.cat([first[k], second[k]]) if first[k].dim() else first[k] for k in first}


def _same(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **tol)


@pytest.mark.timeout(600)
def test_diloco_with_fsdp_inside_equals_ddp_inside_and_resumes(tmp_path):
    """DiLoCo is deterministic: FSDP2 inside each worker ends on the same global model as DDP inside (up to the
    order of float sums in the gradients' reduction); it learns; its checkpoint resumes each rank's shard of the
    inner optimizer state."""
    fsdp = _fit(tmp_path / "fsdp", "sync", "fsdp", save=True)
    ddp = _fit(tmp_path / "ddp", "sync", "ddp")
    assert sorted(fsdp[0]["outer"]["workers"]) == [0, 1] and fsdp[0]["outer"]["steps_done"] == 2 * 40
    assert fsdp[0]["rounds"] == ddp[0]["rounds"]
    assert fsdp[0]["held"] == ddp[0]["held"]  # rank 0's exchange holds nothing more than with DDP inside
    final = _full(fsdp)
    _same(final, _full(fsdp, worker=1), rtol=0, atol=0)  # every rank ends with the global model
    _same(final, ddp[0]["model"], rtol=1e-5, atol=1e-6)
    _same(fsdp[0]["handed_back"], final, rtol=0, atol=0)  # the main process gets the full global model
    seed_everything(0)
    assert _mse(final) < 0.2 * _mse(MLP().state_dict())
    # worker 0's ranks validated the global model together (every 10 steps, mid-round), and trained on from their own
    # shards (else the run would not equal DDP's); the last validation saw the final global model
    assert len(fsdp[0]["val_losses"]) == 4 and fsdp[0]["val_losses"] == fsdp[1]["val_losses"]
    assert fsdp[0]["val_losses"] == pytest.approx(ddp[0]["val_losses"], rel=1e-5)
    assert fsdp[0]["val_losses"][-1] == pytest.approx(_mse(final), rel=1e-5)
    assert fsdp[2]["val_losses"] == []  # the other worker trains on
    # each rank holds its shard: 3 + 2 rows of the first layer's weight; the shards' AdamW states differ
    assert [fsdp[r]["end"]["state"][0]["exp_avg"].shape[0] for r in range(4)] == [3, 2, 3, 2]
    path = tmp_path / "fsdp" / "end.ckpt"
    assert sorted(p.name for p in path.parent.glob("end.ckpt.worker*")) == [
        f"end.ckpt.worker{w}.shard{s}.pt" for w in (0, 1) for s in (0, 1)]
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["state_dict"]["net.0.weight"].shape == (5, 8)  # the full global model: plain Lightning loads it
    resumed = _fit(tmp_path / "resumed", "sync", "fsdp", max_steps=48, ckpt_path=str(path))
    for r in range(4):
        _same(resumed[r]["start"]["state"], fsdp[r]["end"]["state"], rtol=0, atol=0)
    assert resumed[0]["outer"]["steps_done"] == 2 * 48
    assert _mse(_full(resumed)) < _mse(final) * 1.5  # it goes on from where it was, not from the start


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("k_old", "k_new"), [(2, 3), (3, 2)])
def test_fsdp_inside_resumes_with_another_ranks_per_worker(tmp_path, k_old, k_new):
    """Saved as 2 workers x ``k_old`` ranks, resumed as 2 workers x ``k_new`` (issue 42): each new rank starts from
    its rows (FSDP2's Shard(0)) of its worker's whole inner optimizer state, rebuilt here from the saved shard files,
    and training goes on finitely to the budget."""
    _fit(tmp_path / "old", "sync", "fsdp", max_steps=8, save=True, devices=2 * k_old, ranks_per_worker=k_old)
    path = tmp_path / "old" / "end.ckpt"
    saved = {w: [torch.load(f"{path}.worker{w}.shard{j}.pt", weights_only=False) for j in range(k_old)]
             for w in (0, 1)}
    assert all(f["shards"] == k_old for files in saved.values() for f in files)
    resumed = _fit(tmp_path / "new", "sync", "fsdp", max_steps=12, ckpt_path=str(path), devices=2 * k_new,
                   ranks_per_worker=k_new)
    for r in range(2 * k_new):
        worker, j = divmod(r, k_new)
        old = [f["optimizer"]["state"] for f in saved[worker]]
        start = resumed[r]["start"]["state"]
        assert start.keys() == old[0].keys() and start  # AdamW state of every parameter, not a fresh one
        for i in start:
            for name, value in start[i].items():
                if value.dim() == 0:  # step: the same on every rank
                    assert torch.equal(value, old[0][i][name])
                    continue
                whole = torch.cat([o[i][name] for o in old])
                lo, hi = shard_rows(whole.shape[0], k_new, j)
                torch.testing.assert_close(value, whole[lo:hi], rtol=0, atol=0)
    rows_of_first = [resumed[r]["start"]["state"][0]["exp_avg"].shape[0] for r in range(2 * k_new)]
    assert rows_of_first == {2: [3, 2], 3: [2, 2, 1]}[k_new] * 2
    assert resumed[0]["outer"]["steps_done"] == 2 * 12
    final = {k: torch.cat([resumed[r]["model"][k] for r in range(k_new)]) if v.dim() else v
             for k, v in resumed[0]["model"].items()}
    assert all(torch.isfinite(v).all() for v in final.values())
    seed_everything(0)
    assert _mse(final) < _mse(MLP().state_dict())


@pytest.mark.timeout(600)
def test_async_with_fsdp_inside_learns_as_ddp_inside(tmp_path):
    """Async: arrival order varies from run to run, so the final model is compared by its loss, against DDP inside.
    Each linear layer is its own FSDP2 unit here (the whole model is one in the DiLoCo test)."""
    fsdp = _fit(tmp_path / "fsdp", "async", "fsdp", auto_wrap_policy={nn.Linear}, best=True)
    ddp = _fit(tmp_path / "ddp", "async", "ddp")
    best = sorted((tmp_path / "fsdp" / "best").glob("*.ckpt"))
    assert len(best) >= 2
    for path in best:  # each holds the model its score measured, though worker 1 pushed during the validation
        saved = torch.load(path, weights_only=False)
        score = next(s["current_score"] for k, s in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
        torch.testing.assert_close(_val_loss(saved["state_dict"]), score.float(), rtol=1e-6, atol=1e-6)
        for w, shard in ((0, 0), (0, 1), (1, 0), (1, 1)):
            assert "missing" not in torch.load(worker_file(path, w, shard), weights_only=True)
    assert fsdp[0]["outer"]["steps_done"] == 2 * 40 and sorted(fsdp[0]["outer"]["workers"]) == [0, 1]
    for leader, follower in ((0, 1), (2, 3)):
        assert fsdp[leader]["rounds"] == fsdp[follower]["rounds"]
    final = _full(fsdp)
    _same(final, _full(fsdp, worker=1), rtol=0, atol=0)
    seed_everything(0)
    start = _mse(MLP().state_dict())
    assert _mse(final) < 0.2 * start
    assert abs(_mse(final) - _mse(ddp[0]["model"])) < 0.05 * start


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"inside_worker": "zero3"}, r"`inside_worker` must be one of \('ddp', 'fsdp'\), got 'zero3'"),
    ({"inside_worker": "fsdp"}, r"`inside_worker='fsdp'` has no effect with `ranks_per_worker=1`"),
    ({"inside_worker": "fsdp", "ranks_per_worker": 2, "checkpoint_inner_states": True},
     r"`checkpoint_inner_states=True` is not supported with `inside_worker='fsdp'`"),
    ({"auto_wrap_policy": {nn.Linear}}, r"`auto_wrap_policy=.*` has no effect with `inside_worker='ddp'`"),
    ({"inside_worker": "fsdp", "ranks_per_worker": 2, "auto_wrap_policy": 3}, r"`auto_wrap_policy=3` must be None"),
    ({"inside_worker": "fsdp", "ranks_per_worker": 2, "find_unused_parameters": True},
     r"\['find_unused_parameters'\] are DDP arguments and have no effect with `inside_worker='fsdp'`"),
])
def test_fsdp_inside_refused_where_it_has_no_effect(kwargs, match):
    with pytest.raises(ValueError, match=match):
        async_strategy(**kwargs)


def test_full_pieces_read_each_fragment_of_parameters_split_across_fragments():
    """Fragments of 12 values over parameters of 20, 0, 7 and 0 values (split across fragments, empty in the middle
    and at the end): each fragment's pieces are its values, as a one-rank worker reads them."""
    params = [torch.arange(20.0).view(4, 5), torch.empty(0, 3), torch.arange(100.0, 107.0), torch.empty(0)]
    layout = Fragments([p.shape for p in params], max_bytes=4 * 12)
    pieces = list(full_pieces(params, layout))
    assert len(pieces) == len(layout.fragments) > 2
    for fragment, got in zip(layout.fragments, pieces):
        assert torch.equal(torch.cat(got), torch.cat(flat_pieces(params, fragment.start, fragment.end)))


def test_rows_follow_fsdp2_chunks():
    """FSDP2's Shard(0): ceil(n / k) rows per rank, the last ranks' shorter or empty."""

    class _Mesh:
        def __init__(self, rank: int, size: int) -> None:
            self.rank, self.n = rank, size

        def size(self) -> int:
            return self.n

        def get_local_rank(self) -> int:
            return self.rank

    class _Param:
        def __init__(self, n: int, rank: int, size: int) -> None:
            self.shape, self.device_mesh = (n, 3), _Mesh(rank, size)

        def dim(self) -> int:
            return 2

    assert [rows(_Param(5, r, 2)) for r in range(2)] == [(0, 3), (3, 5)]
    assert [rows(_Param(1, r, 2)) for r in range(2)] == [(0, 1), (1, 1)]
    assert [rows(_Param(5, r, 4)) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def _resume_as(path: Path, k: int, rank: int):
    """What ``WorkerCheckpoints._shard_resume`` gives ``rank`` of workers of ``k`` ranks, in one process."""
    stub = types.SimpleNamespace(worker_ranks=WorkerRanks(2 * k, k, rank), global_rank=rank,
                                 checkpoint_io=types.SimpleNamespace(
                                     load_checkpoint=lambda f, **kw: torch.load(f, weights_only=False)))
    stub._read_own = lambda f, weights_only: WorkerCheckpoints._read_own(stub, f, weights_only)
    return WorkerCheckpoints._shard_resume(stub, str(path), None)


def test_shard_resume_without_files_resharded_and_with_a_missing_shard(tmp_path):
    """No files of the worker: None (a fresh state, with a warning); 2 shards read as 3 or as 2; one of the old
    shards missing: an error naming it."""
    path = tmp_path / "end.ckpt"
    assert _resume_as(path, 2, 0) is None
    exp_avg = torch.arange(10.0).view(5, 2)
    for j, (lo, hi) in enumerate([(0, 3), (3, 5)]):
        torch.save({"optimizer": {"state": {0: {"step": torch.tensor(1.0), "exp_avg": exp_avg[lo:hi]}},
                                  "param_groups": [{"params": [0]}]}, "shards": 2}, worker_file(path, 0, j))
    got = [_resume_as(path, 3, r)["optimizer"]["state"][0]["exp_avg"] for r in range(3)]
    assert [g.tolist() for g in got] == [exp_avg[:2].tolist(), exp_avg[2:4].tolist(), exp_avg[4:].tolist()]
    assert torch.equal(_resume_as(path, 2, 1)["optimizer"]["state"][0]["exp_avg"], exp_avg[3:])  # same k: as saved
    head = torch.load(worker_file(path, 0, 0), weights_only=False)
    torch.save({**head, "shards": 3}, worker_file(path, 0, 0))
    with pytest.raises(FileNotFoundError, match=r"end\.ckpt\.worker0\.shard2\.pt is missing, one of the 3 shard"):
        _resume_as(path, 2, 0)
