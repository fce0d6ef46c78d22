"""Run by tests/test_elastic.py and benchmarks/elastic.py: one process of an elastic run on loopback.

``server``: an OuterService for ``LinearModel`` whose evaluation is the validation loss; writes ``--out`` (JSON).
``worker``: one Lightning job (``devices=1``) with ElasticWorkerStrategy (``--devices k``: a job of k ranks,
DDP inside, with ElasticDDPWorkerStrategy; rank r > 0 writes ``--out`` with the suffix ``.rank{r}.json``); ``--die-after N`` SIGKILLs (``--die-by
term``: SIGTERMs, as a preempted spot machine is told) itself in the
middle of its round after N exchanges; ``--step-s`` paces each step (so that the others are mid-run when it dies);
``--nan-from N``: its loss is NaN from its step N on (a worker gone bad); ``--freeze-at join|pull`` SIGSTOPs
itself (heartbeats too) as it is about to meet the service after registering, or to pull its first reply.
``torchft``: one job of DiLoCo on torchft (``TorchFTStrategy``, ``--lighthouse``, ``--job j`` its data order), the
same model and outer settings; ``--progress FILE`` keeps its committed rounds there. ``--go FILE``: a worker or job
says it is ready and waits for the file before ``fit`` (so that start-ups are left out of a run's time). Every process writes its CPU
seconds per inner step between rounds (``--out`` with the suffix ``.cpu<rank>.json``).
"""

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hdet.asynchronous.elastic import (  # noqa: E402
    ElasticDDPWorkerStrategy,
    ElasticWorkerStrategy,
    OuterService,
)
from benchmarks.common import adaptive_rounds  # noqa: E402
from tests.helpers import LinearModel, Regression  # noqa: E402


def val_loss(module: torch.nn.Module) -> dict:
    data = Regression(n=256, seed=0)  # the training task (another seed draws another w*)
    with torch.no_grad():
        return {"val_loss": float(torch.nn.functional.mse_loss(module.layer(data.x), data.y))}


class Pace(Callback):
    """Sleeps ``step_s`` after each step; from step ``hold_at`` on, waits until the file ``hold_until`` exists (the
    fifth worker creates it, ``mark_joined``, once it has joined), so that a joining worker always finds the run
    under way however slowly it starts. ``die_after``: SIGKILL (or ``die_by``) itself mid-round after that many
    exchanges."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.step_s, self.die_after = args.step_s, args.die_after
        self.die_by = signal.SIGTERM if args.die_by == "term" else signal.SIGKILL
        self.hold_at, self.until, self.mark = args.hold_at, args.hold_until, args.mark_joined

    def on_train_start(self, trainer, pl_module):
        if self.mark:
            Path(self.mark).touch()
        self.cpu, self.last, self.round_ended, self.quorums, self.state_bytes = [], None, True, [], 0
        self.written = None  # the committed rounds last written to --progress

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        manager = getattr(trainer.strategy, "_manager", None)
        if self.round_ended and manager is not None:  # torchft: the jobs in this round's quorum
            self.quorums.append(manager.num_participants())
        # process CPU (every thread's: a heartbeat's too) from one step's start to the next, rounds left out
        now = time.process_time()
        if self.last is not None and not self.round_ended:
            self.cpu.append(now - self.last)
        self.last = now

    def on_train_end(self, trainer, pl_module):
        state = getattr(trainer.strategy, "_round", None)  # torchft: what a heal sends
        if state is not None:
            self.state_bytes = sum(4 * t.numel() for t in [state.global_model, *state.optimizer.state[
                state.optimizer.param_groups[0]["params"][0]].values()] if torch.is_tensor(t))
        out = Path(self.args.out)
        out.with_suffix(f".cpu{trainer.global_rank}.json").write_text(json.dumps(self.cpu[self.args.local_steps:]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.round_ended = trainer.global_step % self.args.local_steps == 0
        committed = getattr(trainer.strategy, "rounds_committed", None)
        if self.args.progress and committed is not None and committed != self.written:  # once a round: a write
            Path(self.args.progress).write_text(str(committed))  # costs ~0.1-0.25 ms of CPU, as much as a step's hooks
            self.written = committed
        time.sleep(self.step_s)
        deadline = time.monotonic() + 900
        while self.until and trainer.global_step >= self.hold_at and not os.path.exists(self.until):
            assert time.monotonic() < deadline, "the joining worker never came"
            time.sleep(0.1)
        rounds = getattr(trainer.strategy, "rounds", None)
        if self.die_after and len(rounds) > self.die_after and trainer.global_step % 4 == 2:
            os.kill(os.getpid(), self.die_by)  # mid-round: its unfinished round must be discarded


class NaNFrom(LinearModel):
    """``LinearModel`` whose loss is NaN from step ``nan_from`` on (0: never)."""

    nan_from = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if 0 < self.nan_from <= self.trainer.global_step else loss


class KillRank(Callback):
    """The single-job mode of today: one rank SIGKILLs itself at a given step (as a lost spot machine would)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step >= self.step > 0:
            os.kill(os.getpid(), signal.SIGKILL)


def single(args: argparse.Namespace) -> None:
    """Today's single-job mode on ``--workers`` processes (one Lightning job, one process group)."""
    from lightning_hdet import AsyncLocalSGDStrategy

    seed_everything(0)
    model = LinearModel()
    initial = val_loss(model)["val_loss"]
    strategy = AsyncLocalSGDStrategy(local_steps=adaptive_rounds(args.local_steps, args.mode), start_method=args.start_method,
                                     mode=args.mode)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=args.workers,
                      max_steps=args.budget // args.workers, logger=False, enable_checkpointing=False,
                      callbacks=[Pace(args), KillRank(args.workers - 1, args.kill_at_step)], enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model)
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"initial_loss": initial, "final_loss": val_loss(model)["val_loss"]}))


class JobData(LinearModel):
    """``LinearModel`` whose job ``job`` draws its own order of the training data."""

    job = 0

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1000 + self.job)
        return torch.utils.data.DataLoader(Regression(n=self.hparams.n_train), batch_size=self.hparams.batch_size,
                                           shuffle=True, generator=g)


def wait_for_go(args: argparse.Namespace) -> None:
    """With ``--go``: say this process is ready (``--out`` with the suffix ``.ready``), then wait for the file."""
    if args.go:
        Path(args.out).with_suffix(".ready").touch()
    deadline = time.monotonic() + 600
    while args.go and not os.path.exists(args.go):
        assert time.monotonic() < deadline, "no go"
        time.sleep(0.05)


def marked_torchft(mark: str) -> type:
    """``TorchFT`` whose first quorum request touches the file ``mark`` (``--mark-joined``) half a second after it
    went out: the others, held at a round's end until then (``--hold-at``), find this job waiting in the Lighthouse's
    next quorum however slowly it started (a job that asks after the others' last round waits for no one)."""
    from lightning_hdet.torchft import TorchFT

    class Marked(TorchFT):
        def connect(self, *args):
            manager = super().connect(*args)
            start_quorum = manager.start_quorum

            def marking(*a, **kw):
                threading.Timer(0.5, Path(mark).touch).start()
                manager.start_quorum = start_quorum
                return start_quorum(*a, **kw)
            manager.start_quorum = marking
            return manager
    return Marked


def torchft_job(args: argparse.Namespace) -> None:
    """One job of DiLoCo on torchft (one process): the model, data and outer settings of the elastic runs."""
    from lightning_hdet.torchft import TorchFT, TorchFTStrategy

    logging.basicConfig(level=logging.WARNING)
    seed_everything(0)
    model = JobData()
    model.job = args.job
    mark, args.mark_joined = args.mark_joined, None  # a job marks once its quorum request is out, not at its start
    ft = (marked_torchft(mark) if mark else TorchFT)(
        lighthouse=args.lighthouse, min_replicas=2, replica_id=f"job{args.job}", timeout=10.0, quorum_timeout=120.0,
        connect_timeout=60.0, hostname="localhost", heartbeat_s=args.heartbeat_s)
    strategy = TorchFTStrategy(ft, local_steps=args.local_steps, process_group_backend="gloo")
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=args.budget // args.workers,
                      logger=False, callbacks=[pace := Pace(args)], enable_checkpointing=False, use_distributed_sampler=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    wait_for_go(args)
    trainer.fit(model)
    n = sum(t.numel() for t in model.parameters())
    Path(args.out).write_text(json.dumps({
        "final_loss": val_loss(model)["val_loss"], "committed": strategy.rounds_committed,
        "discarded": strategy.rounds_discarded, "healed": strategy.healed, "round": strategy.round,
        "steps_done": trainer.global_step, "quorums": pace.quorums,
        # payload this job sends: a ring allreduce's 2 (k - 1) / k of the wire, per round; a heal's state, received
        "bytes": int(sum(2 * (k - 1) / k * 4 * (n + 1) for k in pace.quorums)) + strategy.healed * pace.state_bytes}))


def server(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    seed_everything(0)
    model = LinearModel()
    initial = val_loss(model)["val_loss"]
    def evaluate(module: torch.nn.Module) -> dict[str, float]:
        """Validation of the global model, in one place; early stopping below ``--stop-below``."""
        metrics = val_loss(module)
        if metrics["val_loss"] < args.stop_below:
            service.request_stop()
        return metrics

    service = OuterService(model, args.address, args.budget, checkpoint=args.checkpoint, checkpoint_every=1,
                           lease_s=args.lease_s, local_steps=adaptive_rounds(args.local_steps, args.mode), mode=args.mode, evaluate=evaluate,
                           evaluate_every=2 if args.stop_below > 0 else 0, max_idle_s=args.max_idle_s)
    start = time.perf_counter()
    service.run()
    final = val_loss(model)["val_loss"]
    Path(args.out).write_text(json.dumps({
        "initial_loss": initial, "final_loss": final, "finite": bool(torch.isfinite(model.layer.weight).all()),
        "wall_s": time.perf_counter() - start, "summary": service.result.summary(), **service.status()}))


def freeze_before(owner: object, name: str) -> None:
    """SIGSTOP this process (every thread, its heartbeats too) when ``owner.name`` is next called."""
    original = getattr(owner, name)

    def frozen(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)
    setattr(owner, name, frozen)


def worker(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.freeze_at == "join":
        from lightning_hdet.asynchronous.elastic import membership
        freeze_before(membership, "session_group")
    elif args.freeze_at == "pull":
        from lightning_hdet.asynchronous.elastic.transport import SessionWorkerTransport
        freeze_before(SessionWorkerTransport, "pull")
    model = NaNFrom()
    model.nan_from = args.nan_from
    kind = ElasticDDPWorkerStrategy if args.devices > 1 else ElasticWorkerStrategy
    strategy = kind(args.address, reconnect_s=args.reconnect_s, heartbeat_s=0.5)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=args.devices, max_epochs=-1, logger=False,
                      callbacks=[Pace(args)], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    wait_for_go(args)
    trainer.fit(model)
    out = Path(args.out)
    if trainer.global_rank > 0:
        out = out.with_suffix(f".rank{trainer.global_rank}.json")
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    pulled = strategy._worker.pulled[: params.numel()] if strategy._worker is not None else torch.empty(0)
    out.write_text(json.dumps({"sessions": strategy.sessions, "inner_steps": strategy.inner_steps,
                               "rounds": strategy.rounds, "params": params.tolist(), "pulled": pulled.tolist()}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["server", "worker", "single", "torchft"])
    parser.add_argument("--address", default=None)
    parser.add_argument("--lighthouse", default=None)  # of `torchft`
    parser.add_argument("--job", type=int, default=0)  # of `torchft`: its data order
    parser.add_argument("--progress", default=None)
    parser.add_argument("--go", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, default=240)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--lease-s", type=float, default=10.0)
    parser.add_argument("--max-idle-s", type=float, default=None)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--hold-at", type=int, default=0)
    parser.add_argument("--hold-until", default=None)
    parser.add_argument("--mark-joined", default=None)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--die-by", choices=("kill", "term"), default="kill")
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--nan-from", type=int, default=0)
    parser.add_argument("--freeze-at", choices=("join", "pull"), default=None)
    parser.add_argument("--reconnect-s", type=float, default=60.0)
    parser.add_argument("--stop-below", type=float, default=0.0)
    parser.add_argument("--start-method", default="popen", choices=("popen", "spawn", "fork"))  # of `single`
    parser.add_argument("--heartbeat-s", type=float, default=0.5)  # of `torchft`: TorchFT(heartbeat_s=...)
    parser.add_argument("--workers", type=int, default=4)  # of `single`: its ranks
    parser.add_argument("--devices", type=int, default=1)  # of `worker`: the ranks of its job (DDP inside)
    args = parser.parse_args()
    {"server": server, "worker": worker, "single": single, "torchft": torchft_job}[args.role](args)
