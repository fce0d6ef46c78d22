"""Workers of several ranks (``ranks_per_worker``): the rank layout and its checks in one process, and 4
processes as 2 workers x 2 ranks through Lightning's Trainer (gloo, fork), async and DiLoCo."""

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn
from torch.utils.data import TensorDataset

import lightning_hdet  # noqa: F401  (registers the strategies)
from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy, SlowRanks, WorkerShape
from lightning_hdet.asynchronous.exchange.ranks import FollowerTransport, LeaderTransport, WorkerRanks
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.wire.messages import Kind, ServerHeader, WorkerHeader
from lightning_hdet.asynchronous.wire.transport import WorkerTransport
from tests.helpers import LinearModel, START, flat_params, load_ranks, trainer_kwargs
from tests.test_async_local_sgd import Regression


def test_rank_layout_consecutive_ranks_per_worker():
    layout = [WorkerRanks(8, 4, r) for r in range(8)]  # 2 nodes x 4 GPUs: one worker per node
    assert [w.worker for w in layout] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [w.leader for w in layout] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [r for r, w in enumerate(layout) if w.is_leader] == [0, 4]
    assert layout[5].workers == 2 and layout[5].ranks_of(1) == [4, 5, 6, 7]
    assert WorkerRanks(6, 1, 5).worker == 5 and WorkerRanks(6, 1, 5).is_leader  # one rank per worker: as before
    assert layout[6].describe() == "worker 1 (ranks 4-7, on rank 6)"


@pytest.mark.parametrize(("k", "devices", "match"), [
    (3, 4, "`ranks_per_worker=3` does not divide the world size 4"),
    (4, 4, "`ranks_per_worker=4` makes 1 worker of 4 ranks"),
    (0, 4, "`ranks_per_worker` must be a positive integer, got 0"),
    (2.0, 4, "`ranks_per_worker` must be a positive integer, got 2.0"),
    (True, 4, "`ranks_per_worker` must be a positive integer, got True"),
])
def test_bad_ranks_per_worker_refused_before_process_groups(k, devices, match):
    with pytest.raises(ValueError, match=match):
        Trainer(strategy=AsyncLocalSGDStrategy(worker=WorkerShape(ranks_per_worker=k)), accelerator="cpu",
                devices=devices, logger=False)


def test_workers_counted_not_ranks():
    strategy = AsyncLocalSGDStrategy(outer=DelayedNesterov(lr=0.5, buffer_size=2), worker=WorkerShape(ranks_per_worker=2))
    Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    assert strategy.config["workers"] == 2 and strategy.config["ranks_per_worker"] == 2
    with pytest.raises(ValueError, match="`buffer_size` must be 1..2"):  # N is checked against the workers, not ranks
        Trainer(strategy=AsyncLocalSGDStrategy(outer=DelayedNesterov(lr=0.5, buffer_size=3),
                                               worker=WorkerShape(ranks_per_worker=2)),
                accelerator="cpu", devices=4, logger=False)
    with pytest.raises(ValueError, match="ddp_comm_hook"):  # nothing to hook with one rank per worker
        AsyncLocalSGDStrategy(ddp_comm_hook=lambda *a: None)


class _Server(WorkerTransport):
    """The leader's own transport to the server, in memory."""

    def __init__(self, reply: ServerHeader, model: torch.Tensor) -> None:
        self.reply, self.model, self.pushed = reply, model, []

    def push(self, header, messages, buffers, inner_state):
        self.pushed.append((header, [m.clone() for m in messages]))

    def pull(self, into):
        if self.reply.next_local_steps > 0:
            into.copy_(self.model)
        return self.reply


class _Group:
    """Two ranks' collectives, run one rank after the other: the leader's broadcasts are queued for the follower,
    and the max-reduce keeps the largest value seen (the follower reports first here)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.largest = -1.0

    def leader_broadcast(self, t):
        self.sent.append(t.clone())

    def follower_broadcast(self, t):
        t.copy_(self.sent.pop(0))

    def max_reduce(self, t):
        self.largest = max(self.largest, float(t[0]))
        t.fill_(self.largest)


@pytest.mark.parametrize("steps", [5, 0])
def test_leader_pushes_once_with_the_slowest_time_and_hands_the_reply_on(steps):
    group, model = _Group(), torch.arange(4.0)
    server = _Server(ServerHeader(steps, 7, 1), model)
    leader = LeaderTransport(server, group.leader_broadcast, group.max_reduce)
    follower = FollowerTransport(group.follower_broadcast, group.max_reduce)
    never_read = iter(lambda: pytest.fail("a follower's pseudo-gradient is read"), None)
    follower.push(WorkerHeader(Kind.PUSH, 3, 2.5, 0.0, 0), never_read, None, None)
    leader.push(WorkerHeader(Kind.PUSH, 3, 1.0, 0.0, 0), iter([torch.ones(2)]), None, None)
    assert len(server.pushed) == 1 and server.pushed[0][0].compute_s == 2.5  # the worker's slowest rank
    mine, theirs = torch.zeros(4), torch.full((4,), -1.0)
    assert leader.pull(mine) == follower.pull(theirs) == ServerHeader(steps, 7, 1)
    expected = model if steps else torch.full((4,), -1.0)  # a stop reply carries no model
    assert torch.equal(theirs, expected) and not group.sent


def _held_bytes(exchange, module, inner_optimizer) -> int:
    """Bytes of the tensors rank 0's exchange holds (outer state, server, worker, transports), each storage once;
    the model and the inner optimizer (the user's, as under DDP) excluded."""
    seen, storages, total, stack = set(), set(), 0, [exchange]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is module or obj is inner_optimizer:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("lightning_hdet", "torch.optim")) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return total


class _Steps(Callback):
    """Each rank records its parameters after every inner step, by its worker's inner-step count."""

    def __init__(self, out: Path) -> None:
        self.out, self.params = out, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params[trainer.strategy.inner_steps] = flat_params(pl_module)

    def on_fit_end(self, trainer, pl_module):
        s = trainer.strategy
        torch.save({"params": self.params, "rounds": s.rounds, "inner_steps": s.inner_steps,
                    "outer": s._outer.state_dict() if s._outer is not None else None,
                    "val_losses": pl_module.val_losses, "final": flat_params(pl_module),
                    "held": _held_bytes(s._exchange, pl_module, trainer.optimizers[0])},
                   self.out / f"rank{trainer.global_rank}.pt")


def _fit(tmp_path, mode, ranks_per_worker, max_steps, local_steps=4, devices=4, pull="none"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    seed_everything(0)
    # plain averaging outer step (Local SGD): what is under test is the workers' ranks, not the outer optimizer
    strategy = AsyncLocalSGDStrategy(local_steps=local_steps, mode=mode, outer=DelayedNesterov(lr=1.0, momentum=0.0),
                                     pull_compression=pull, start_method=START,
                                     worker=WorkerShape(ranks_per_worker=ranks_per_worker))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      max_steps=max_steps, val_check_interval=4, check_val_every_n_epoch=None,
                      num_sanity_val_steps=0, callbacks=[_Steps(tmp_path)])
    trainer.fit(Regression())
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mode", "pull"), [("async", "none"), ("sync", "none"), ("sync", "int8")])
def test_two_workers_of_two_ranks(tmp_path, mode, pull):
    """int8 pulls: the leader adds the changes to the public model it holds, then hands the result to its other
    rank, so the two stay identical as with float32 pulls."""
    ranks = _fit(tmp_path, mode, ranks_per_worker=2, max_steps=40, pull=pull)
    outer = ranks[0]["outer"]
    assert sorted(outer["workers"]) == [0, 1]  # the server sees 2 workers, not 4 ranks
    # each worker's ranks took the same steps and rounds; the budget counts worker steps (2 workers x 40)
    for leader, follower in ((0, 1), (2, 3)):
        assert ranks[leader]["inner_steps"] == ranks[follower]["inner_steps"] > 0
        assert ranks[leader]["rounds"] == ranks[follower]["rounds"]
        assert ranks[leader]["params"].keys() == ranks[follower]["params"].keys()
        for step, params in ranks[leader]["params"].items():  # DDP inside: identical after every inner step
            torch.testing.assert_close(ranks[follower]["params"][step], params, rtol=0, atol=0)
    assert ranks[0]["inner_steps"] + ranks[2]["inner_steps"] == outer["steps_done"] == 2 * 40
    for worker, leader in ((0, 0), (1, 2)):  # one push per round per worker (its leader's)
        stats = outer["workers"][worker]
        assert stats["rounds"] == len(ranks[leader]["rounds"]) - 1 and stats["steps"] == ranks[leader]["inner_steps"]
    pushes = sum(len(ranks[r]["rounds"]) - 1 for r in (0, 2))
    assert outer["outer_updates"] == (pushes if mode == "async" else pushes // 2)  # DiLoCo: one per pair
    # the two workers train apart (different data) between exchanges
    first = min(ranks[0]["params"])
    assert not torch.equal(ranks[0]["params"][first], ranks[2]["params"][first])
    # it learns: the global model every rank ends with, against the initial model, on the whole task
    data = Regression().data
    seed_everything(0)
    start, end = flat_params(Regression()), ranks[0]["final"]
    for r in ranks[1:]:
        torch.testing.assert_close(r["final"], end, rtol=0, atol=0)
    assert _mse(end, data) < 0.2 * _mse(start, data)


def _mse(params: torch.Tensor, data: TensorDataset) -> float:
    x, y = data.tensors
    return float(nn.functional.mse_loss(x.double() @ params[:8, None] + params[8], y.double()))


@pytest.mark.timeout(300)
def test_rank_zero_holds_what_it_holds_with_one_rank_per_worker(tmp_path):
    """Rank 0's exchange (outer state, server, its worker) holds the same tensors for 2 workers of 2 ranks as for 2
    workers of one rank: nothing on rank 0 grows with the ranks (docs/async.md, "Rank 0's memory")."""
    two_by_two = _fit(tmp_path / "a", "sync", ranks_per_worker=2, max_steps=8)
    two_by_one = _fit(tmp_path / "b", "sync", ranks_per_worker=1, max_steps=8, devices=2)
    model_bytes = 4 * 9
    assert two_by_two[0]["held"] == two_by_one[0]["held"] >= 3 * model_bytes  # global params, momentum, pulled


class _InnerStates(Callback):
    """Each rank records its inner optimizer state at the start of training and writes a checkpoint at the end."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        self.start = copy.deepcopy(trainer.optimizers[0].state_dict())

    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(self.out / "end.ckpt")
        torch.save({"start": self.start, "end": trainer.optimizers[0].state_dict()},
                   self.out / f"rank{trainer.global_rank}.pt")


def _fit_adam(out: Path, ranks_per_worker: int, max_steps: int, ckpt_path: str | None = None):
    seed_everything(0)
    out.mkdir(parents=True)
    strategy = AsyncLocalSGDStrategy(local_steps=2, mode="sync", start_method=START,
                                     worker=WorkerShape(ranks_per_worker=ranks_per_worker))
    trainer = Trainer(strategy=strategy, callbacks=[_InnerStates(out)], **trainer_kwargs(
        devices=4, max_steps=max_steps, enable_checkpointing=True, default_root_dir=out))
    trainer.fit(LinearModel(optimizer="adam", n_train=64, batch_size=8), ckpt_path=ckpt_path)
    return load_ranks(out, 4)


def _same_state(a, b) -> None:
    torch.testing.assert_close(a["state"], b["state"], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_checkpoints_per_worker_and_resume_with_another_layout(tmp_path):
    ranks = _fit_adam(tmp_path / "a", 2, max_steps=6)
    path = tmp_path / "a" / "end.ckpt"
    files = sorted(p.name for p in (tmp_path / "a").glob("end.ckpt.worker*.pt"))
    assert files == ["end.ckpt.worker0.pt", "end.ckpt.worker1.pt"]  # one file per worker, by its leader
    for worker, worker_ranks in ((0, (0, 1)), (1, (2, 3))):
        own = torch.load(f"{path}.worker{worker}.pt", weights_only=True)["optimizer"]
        for r in worker_ranks:
            _same_state(own, ranks[r]["end"])
    assert not torch.equal(ranks[0]["end"]["state"][0]["exp_avg"], ranks[2]["end"]["state"][0]["exp_avg"])
    # resumed as 2 x 2: every rank of a worker from its worker's file
    resumed = _fit_adam(tmp_path / "b", 2, max_steps=8, ckpt_path=str(path))
    for r in range(4):
        _same_state(resumed[r]["start"], ranks[r]["end"])
    # resumed as 4 workers of one rank: workers 0 and 1 (ranks 0, 1) have files; workers 2 and 3 start from rank 0's
    resumed = _fit_adam(tmp_path / "c", 1, max_steps=8, ckpt_path=str(path))
    _same_state(resumed[1]["start"], ranks[2]["end"])
    for r in (0, 2, 3):
        _same_state(resumed[r]["start"], ranks[0]["end"])
    assert all(bool(torch.isfinite(r["end"]["state"][0]["exp_avg"]).all()) for r in resumed)


@pytest.mark.timeout(300)
def test_an_early_stop_on_rank_zero_stops_its_worker_at_the_end_of_its_round(tmp_path):
    """EarlyStopping decides on rank 0 in the middle of a round (validation every 4 steps, rounds of 3): rank 0 must
    not leave its worker's other rank waiting for its gradients; the worker stops, both ranks, when the round ends."""
    seed_everything(0)
    strategy = AsyncLocalSGDStrategy(local_steps=3,
                                     timeout=timedelta(seconds=120), start_method=START,
                                     worker=WorkerShape(ranks_per_worker=2))
    stop = EarlyStopping(monitor="val_loss", mode="max", patience=0)  # the loss falls: stops at the 2nd validation
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=4, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      max_steps=100, val_check_interval=4, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      callbacks=[stop, _Steps(tmp_path)])
    trainer.fit(Regression())
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    # decided at step 8 (the 2nd validation; Lightning validates once more as the loop stops), in the round of
    # steps 7-9: rank 0 goes on to step 9 with its worker's other rank
    assert len(ranks[0]["val_losses"]) == 3
    assert ranks[0]["inner_steps"] == ranks[1]["inner_steps"] == 9
    assert ranks[2]["inner_steps"] == ranks[3]["inner_steps"] < 100  # the other worker stopped at its next exchange
    assert ranks[0]["outer"]["steps_done"] < 2 * 100


def test_a_worker_across_two_nodes_warns():
    with pytest.warns(UserWarning, match="ranks_per_worker=3 with devices=2 per node: some workers span two nodes"):
        Trainer(strategy=AsyncLocalSGDStrategy(worker=WorkerShape(ranks_per_worker=3)), accelerator="cpu", devices=2, num_nodes=3,
                logger=False)


@pytest.mark.timeout(300)
def test_dynamic_local_steps_follow_each_workers_slowest_rank(tmp_path):
    """Rank 3 (not a leader) is 4x slower: its worker (ranks 2, 3) gets about 1/4 of the other worker's rounds."""
    seed_everything(0)
    strategy = AsyncLocalSGDStrategy(local_steps=AdaptiveSteps(8), start_method=START, worker=WorkerShape(ranks_per_worker=2))
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=4, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      max_steps=40, limit_val_batches=0, num_sanity_val_steps=0,
                      callbacks=[SlowRanks({3: 4.0}, base_seconds=0.1), _Steps(tmp_path)])
    trainer.fit(Regression())
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert ranks[0]["inner_steps"] + ranks[2]["inner_steps"] == 2 * 40
    assert ranks[0]["inner_steps"] > 1.5 * ranks[2]["inner_steps"]
    # the server measured worker 1 at its slow rank's pace (the round lengths follow the measured speeds: the
    # local-steps policy's own tests)
    stats = ranks[0]["outer"]["workers"]
    assert stats[1]["steps_per_s"] < 0.6 * stats[0]["steps_per_s"], stats
    assert max(n for n, _ in ranks[2]["rounds"][1:]) < max(n for n, _ in ranks[0]["rounds"][1:])
