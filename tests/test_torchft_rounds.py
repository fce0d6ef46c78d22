"""DiLoCo on torchft in one process: a job's rounds (lightning_hdet/torchft/rounds.py) against a fake torchft
``Manager`` whose allreduce adds the other jobs' contributions; the settings' and the strategy's checks. Values are
computed by hand in the comments."""

from __future__ import annotations

import math
from concurrent.futures import Future
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp

from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, DelayedNesterovOptimizer, Nesterov
from lightning_hdet.torchft import TorchFT, TorchFTStrategy
from lightning_hdet.torchft.rounds import LINEAGE_BITS, STATE_KEY, ReplicaRound, SplitBrainError

CPU = torch.device("cpu")


class FakeManager:
    """torchft's Manager as a round uses it: ``allreduce`` (SUM) adds ``peers``' wire vectors to this job's (each
    ``[pseudo-gradient, buffers, accepted]``: a peer holding this job's lineage, whose bits and 1 are put in; or the
    whole wire) and keeps what this job sent (``sent``: without the lineage's part; ``wires``: whole);
    ``should_commit`` answers ``commit``; ``start_quorum`` heals with ``heal_from``'s state when set and allowed
    (as torchft does for a job behind); ``late``: the round-end quorum is formed without this job (its wait times
    out); ``calls``: what was called, in order."""

    def __init__(self, peers: list[list[float]] = (), commit: bool = True) -> None:
        self.peers, self.commit = [torch.tensor(p) for p in peers], commit
        self.sent: list[torch.Tensor] = []
        self.wires: list[torch.Tensor] = []
        self.heal_from: dict | None = None
        self.calls: list[str] = []
        self.fns: dict = {}
        self.late, self.timeouts = False, []  # late: left out of the round-end quorum
        self._quorum_future: Future | None = None

    def register_state_dict_fn(self, key, load, save):  # type: ignore[no-untyped-def]
        self.fns[key] = (load, save)

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta = None) -> None:
        if self._quorum_future is not None:  # as torchft 0.2.0: the last quorum's failure is raised again here
            self._quorum_future.result()
        self.calls.append("shrink-only quorum" if shrink_only and not allow_heal else "quorum")
        self._quorum_future = Future()
        if shrink_only and self.late:  # the Lighthouse formed this quorum without the job: its wait times out
            self.timeouts.append(timeout)
            self._quorum_future.set_exception(TimeoutError("Timeout expired"))
            self._quorum_future.result()
        self._quorum_future.set_result(None)
        if allow_heal and self.heal_from is not None:
            self.fns[STATE_KEY][0](self.heal_from)

    def allreduce(self, tensor: torch.Tensor, reduce_op: ReduceOp) -> "FakeManager":
        assert reduce_op == ReduceOp.SUM
        self.calls.append("allreduce")
        self.wires.append(tensor.clone())
        lineage = tensor[-LINEAGE_BITS - 2:-1].clone()  # this job's lineage bits and its 1
        self.sent.append(torch.cat([tensor[:-LINEAGE_BITS - 2], tensor[-1:]]))
        for p in self.peers:
            if len(p) < len(tensor):
                p = torch.cat([p[:-1], lineage.to(p.dtype), p[-1:]])
            tensor.add_(p)
        return self

    def wait(self) -> bool:
        return True

    def should_commit(self) -> bool:
        return self.commit


def nesterov(params: torch.Tensor) -> DelayedNesterovOptimizer:  # outer="published": lr 0.7, momentum 0.9
    return DelayedNesterovOptimizer([params], lr=0.7, momentum=0.9, buffer_size=1)


def linear(w: list[float]) -> nn.Linear:
    m = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([w]))
    return m


def trained(module: nn.Module, w: list[float]) -> None:
    """The round's inner steps, as their result."""
    with torch.no_grad():
        module.weight.copy_(torch.tensor([w]))


def test_a_round_steps_every_job_with_the_mean_of_the_accepted_pseudo_gradients():
    module, manager = linear([1.0, 2.0]), FakeManager(peers=[[1.5, 3.0, 1.0]])
    ft = ReplicaRound(module, CPU, manager, nesterov, PushCheck())
    ft.start()
    trained(module, [0.5, 1.0])  # pseudo-gradient global - local = [0.5, 1.0]
    out = ft.finish()
    assert torch.equal(manager.sent[0], torch.tensor([0.5, 1.0, 1.0]))  # [pseudo-gradient, accepted]
    # the quorum again right before the allreduce, shrink-only: a job frozen mid-round is left out of it
    assert manager.calls == ["quorum", "shrink-only quorum", "allreduce"]
    # mean [1.0, 2.0]; Nesterov from zero momentum: m = g, step 0.7 * (g + 0.9 m) = 1.33 g
    assert (out.committed, out.accepted, out.rejected) == (True, 2, None)
    assert torch.allclose(module.weight, torch.tensor([[1.0 - 1.33, 2.0 - 2.66]]))
    assert torch.equal(ft.global_model, module.weight.detach().reshape(-1))
    # second round, the same mean: m = 0.9 [1, 2] + [1, 2] = [1.9, 3.8]; step 0.7 (g + 0.9 m) = 0.7 * 2.71 g
    trained(module, (ft.global_model - torch.tensor([0.5, 1.0])).tolist())
    ft.finish()
    assert torch.allclose(module.weight, torch.tensor([[1.0 - 1.33 - 1.897, 2.0 - 2.66 - 3.794]]), atol=1e-6)


def test_a_bf16_wire_carries_the_pseudo_gradient_rounded_to_bfloat16_and_checks_it_in_float32():
    """``wire_dtype=bfloat16`` (``compression=BF16()``): 2 bytes a value on the wire. This job's pseudo-gradient
    [1/3, 1] travels as bfloat16 (1/3 -> 0.333984375); the peer's [1/3, 3] likewise; plain SGD outer step (lr 1):
    theta = [1, 2] - the mean of the two as bfloat16 sums them."""
    module, manager = linear([1.0, 2.0]), FakeManager()
    manager.peers = [torch.tensor([1 / 3, 3.0, 1.0], dtype=torch.bfloat16)]
    sgd = lambda params: torch.optim.SGD([params], lr=1.0)  # noqa: E731
    ft = ReplicaRound(module, CPU, manager, sgd, PushCheck(), wire_dtype=torch.bfloat16)
    trained(module, [1.0 - 1 / 3, 1.0])
    out = ft.finish()
    third = float(torch.tensor(1 / 3).to(torch.bfloat16))
    assert manager.sent[0].dtype == torch.bfloat16 and manager.sent[0].tolist() == [third, 1.0, 1.0]
    assert ft.wire.element_size() == 2 and ft.delta.dtype == torch.float32
    mean = (torch.tensor([2 * third, 4.0], dtype=torch.bfloat16).float() / 2).tolist()
    assert out.accepted == 2 and ft.global_model.tolist() == [1.0 - mean[0], 2.0 - mean[1]]


def test_a_non_finite_pseudo_gradient_is_left_out_of_the_mean_and_its_job_restarts_from_the_global_model():
    module, manager = linear([1.0, 2.0]), FakeManager(peers=[[1.0, 2.0, 1.0]])
    ft = ReplicaRound(module, CPU, manager, nesterov, PushCheck())
    trained(module, [math.nan, 1.0])
    out = ft.finish()
    assert torch.equal(manager.sent[0], torch.zeros(3))  # nothing of it reaches the others
    assert out.accepted == 1 and "non-finite" in out.rejected and ft.rejected_streak == 1
    # the peer's [1, 2] alone: 1.33 [1, 2]
    assert torch.allclose(module.weight, torch.tensor([[1.0 - 1.33, 2.0 - 2.66]]))
    trained(module, (ft.global_model - torch.tensor([0.1, 0.1])).tolist())
    assert ft.finish().rejected is None and ft.rejected_streak == 0


def test_a_pseudo_gradient_far_above_its_recent_median_is_rejected():
    module, manager = linear([0.0, 0.0]), FakeManager()
    ft = ReplicaRound(module, CPU, manager, lambda p: DelayedNesterovOptimizer([p], lr=1.0, momentum=0.0), PushCheck())
    for _ in range(4):  # norms 1: the median the rule needs (min_history 4)
        trained(module, (ft.global_model - torch.tensor([0.6, 0.8])).tolist())
        assert ft.finish().rejected is None
    before = ft.global_model.clone()
    trained(module, (ft.global_model - torch.tensor([60.0, 80.0])).tolist())  # norm 100 > 10 x 1
    out = ft.finish()
    assert "norm 100" in out.rejected and out.accepted == 0
    assert torch.equal(ft.global_model, before) and torch.equal(module.weight.detach().reshape(-1), before)


def test_a_round_torchft_does_not_commit_is_discarded():
    module, manager = linear([1.0, 2.0]), FakeManager(peers=[[1.0, 1.0, 1.0]], commit=False)
    ft = ReplicaRound(module, CPU, manager, nesterov, None)
    trained(module, [0.0, 0.0])
    out = ft.finish()
    assert (out.committed, out.accepted) == (False, 0)
    assert torch.equal(module.weight, torch.tensor([[1.0, 2.0]]))  # back at the global model, which did not move
    assert not ft.optimizer.state  # no outer step: no momentum


def test_a_job_behind_heals_from_a_live_peer_at_the_round_start():
    live_module, live = linear([1.0, 2.0]), FakeManager(peers=[[1.0, 2.0, 1.0]])
    peer = ReplicaRound(live_module, CPU, live, nesterov, None)
    trained(live_module, [0.0, 0.0])
    peer.finish()  # the live job is a round ahead, with momentum
    module, manager = linear([9.0, 9.0]), FakeManager(peers=[[1.0, 2.0, 1.0]])
    new = ReplicaRound(module, CPU, manager, nesterov, None)
    manager.heal_from = live.fns[STATE_KEY][1]()
    new.start()
    assert torch.equal(module.weight, live_module.weight) and torch.equal(new.global_model, peer.global_model)
    assert new.lineage == peer.lineage != 0
    for job in (new, peer):  # the same next round: the same model after it (the momentum came along)
        trained(job.module, (job.global_model - 1.0).tolist())
        job.finish()
    assert torch.equal(module.weight, live_module.weight) and new.lineage == peer.lineage


def test_a_job_left_out_of_the_round_end_quorum_discards_its_round_then_heals_from_a_live_peer():
    """A live job later than the join timeout at the round's end: the others reduced without it, its quorum times out
    (after ``round_end_timeout``). It discards the round (nothing sent, no outer step), restarts from the global
    model, and the next round's quorum (asked afresh, though torchft keeps the failed one) heals it to the peers'."""
    module, manager = linear([1.0, 2.0]), FakeManager(peers=[[1.0, 1.0, 1.0]])
    ft = ReplicaRound(module, CPU, manager, nesterov, PushCheck(), round_end_timeout=timedelta(seconds=7))
    ft.start()
    trained(module, [0.0, 0.0])
    manager.late = True
    out = ft.finish()
    assert (out.committed, out.accepted, out.rejected, out.left_out) == (False, 0, None, True)
    assert manager.timeouts == [timedelta(seconds=7)] and "allreduce" not in manager.calls
    assert torch.equal(module.weight, torch.tensor([[1.0, 2.0]])) and not ft.optimizer.state
    manager.late, manager.heal_from = False, {"global_model": torch.tensor([5.0, 6.0]), "lineage": 7,
                                              "outer": nesterov(torch.zeros(2)).state_dict()}
    ft.start()
    assert torch.equal(module.weight, torch.tensor([[5.0, 6.0]]))
    trained(module, [4.0, 5.0])  # pseudo-gradient [1, 1], the peer's too: 1.33 [1, 1] from [5, 6]
    assert ft.finish().committed
    assert torch.allclose(module.weight, torch.tensor([[5.0 - 1.33, 6.0 - 1.33]]))


def lineage_wire(delta: list[float], lineage: int, accepted: float = 1.0) -> torch.Tensor:
    """A job's whole wire: ``[pseudo-gradient, lineage bits, 1, accepted]``."""
    return torch.tensor(delta + [float((lineage >> i) & 1) for i in range(LINEAGE_BITS)] + [1.0, accepted])


def test_a_committed_round_chains_the_lineage_over_the_reduced_wire_and_every_job_of_it_holds_the_same():
    """A fresh job's lineage is 0: it sends 32 zero bits and a 1. Its peer holds lineage 0 too: the bits' sums are 0,
    the jobs' 2, nothing differs. The reduced wire [1, 2, 0 x 32, 2, 2] as float32 bit patterns (32-bit words)
    sums to 0x3F800000 + 3 x 0x40000000 = 4286578688 (below 2**32; no bytes left over); the lineage becomes
    blake2b("0:4286578688:") (4 bytes, little-endian), and the next round sends its bits."""
    import hashlib

    module, manager = linear([1.0, 2.0]), FakeManager(peers=[[0.5, 1.0, 1.0]])
    ft = ReplicaRound(module, CPU, manager, nesterov, PushCheck())
    trained(module, [0.5, 1.0])
    assert ft.finish().committed
    assert torch.equal(manager.wires[0], lineage_wire([0.5, 1.0], 0))
    expected = int.from_bytes(hashlib.blake2b(b"0:4286578688:", digest_size=4).digest(), "little")
    assert ft.lineage == expected != 0
    trained(module, (ft.global_model - 1.0).tolist())
    ft.finish()
    assert torch.equal(manager.wires[1], lineage_wire([1.0, 1.0], expected))


def test_jobs_that_committed_rounds_apart_meet_in_one_quorum_and_every_one_stops_with_a_split_brain_error():
    """Jobs X and Y start from one model (lineage 0) and commit a round each in a quorum apart (X with a peer of
    pseudo-gradient [1, 1], Y with one of [3, 3]: a split brain): their models and lineages differ though torchft
    holds both at round 1. They then meet in one quorum: each bit where the two lineages differ sums to 1 of 2 jobs,
    so both see it, apply nothing and stop, naming the cause and the fix; the rejected pseudo-gradient of Y still
    carries its lineage."""
    jobs = {}
    for name, peer in (("x", [1.0, 1.0, 1.0]), ("y", [3.0, 3.0, 1.0])):
        module = linear([1.0, 2.0])
        jobs[name] = ReplicaRound(module, CPU, FakeManager(peers=[peer]), nesterov, PushCheck())
        trained(module, [0.0, 1.0])  # pseudo-gradient [1, 1]
        assert jobs[name].finish().committed
    x, y = jobs["x"], jobs["y"]
    assert x.lineage != y.lineage and not torch.equal(x.global_model, y.global_model)
    x.manager.peers = [lineage_wire([0.0, 0.0], y.lineage, accepted=0.0)]  # Y's round rejected: zeros, lineage
    y.manager.peers = [lineage_wire([1.0, 1.0], x.lineage)]
    for job in (x, y):
        before = job.global_model.clone()
        trained(job.module, (before - 1.0).tolist())
        with pytest.raises(SplitBrainError, match=r"The 2 jobs of this round's quorum hold different global models "
                                                  r"\(.*at most 1 of them hold this job's\).*Set min_replicas above "
                                                  r"half the jobs.*resume that job from it and start the others "
                                                  r"afresh"):
            job.finish()
        assert torch.equal(job.global_model, before)


def test_floating_point_buffers_take_the_mean_of_the_accepted_jobs():
    module = nn.Sequential(nn.Linear(1, 1, bias=False), nn.BatchNorm1d(1, affine=False))
    with torch.no_grad():
        module[0].weight.fill_(1.0)
    # wire: [weight's pseudo-gradient, running_mean, running_var, accepted]
    manager = FakeManager(peers=[[0.0, 3.0, 5.0, 1.0]])
    ft = ReplicaRound(module, CPU, manager, nesterov, None)
    module[1].running_mean.fill_(1.0)
    module[1].running_var.fill_(3.0)
    ft.finish()
    assert module[1].running_mean.item() == 2.0 and module[1].running_var.item() == 4.0


def test_torchft_settings_and_the_strategy_refuse_what_would_not_run():
    ok = TorchFT(lighthouse="http://localhost:29510", min_replicas=2)
    with pytest.raises(ValueError, match="`lighthouse` must be an address 'http://HOST:PORT'"):
        TorchFT(lighthouse="localhost:29510", min_replicas=2)
    with pytest.raises(ValueError, match="`min_replicas` must be a positive integer"):
        TorchFT(lighthouse="http://h:1", min_replicas=0)
    with pytest.raises(ValueError, match="`quorum_timeout` must be"):
        TorchFT(lighthouse="http://h:1", min_replicas=1, quorum_timeout=0)
    with pytest.raises(ValueError, match="Did you mean `timeout`"):
        TorchFT(lighthouse="http://h:1", min_replicas=1, timeot=3)
    with pytest.raises(ValueError, match="`mode` must be 'sync'.*OuterService"):
        TorchFTStrategy(ok, mode="async")
    with pytest.raises(ValueError, match="SparseLoCo.* is not supported by TorchFTStrategy"):
        TorchFTStrategy(ok, outer="sparseloco")
    with pytest.raises(ValueError, match=r"no longer takes `outer_lr`=0.7.* outer=DelayedNesterov\(lr=...\)"):
        TorchFTStrategy(ok, outer_lr=0.7)
    with pytest.raises(ValueError, match="Did you mean `local_steps`"):
        TorchFTStrategy(ok, local_step=5)
    with pytest.raises(ValueError, match=r"`compression` must be NoCodec\(\) or BF16\(\), got Int8.*BF16\(\) halves"):
        TorchFTStrategy(ok, compression="int8")
    assert TorchFTStrategy(ok, compression="bf16").config["compression"] == "BF16"
    with pytest.raises(ValueError, match="`torchft` must be a TorchFT"):
        TorchFTStrategy("http://h:1")  # type: ignore[arg-type]
    config = TorchFTStrategy(ok, local_steps=5, outer=Nesterov(lr=0.7), check_pushes=PushCheck(max_rejections=5)).config
    assert (config["outer"], config["outer/lr"], config["outer/momentum"]) == ("Nesterov", 0.7, 0.9)
    assert (config["check_pushes/max_rejections"], config["local_steps"], config["torchft_min_replicas"]) == (5, 5, 2)
    assert TorchFTStrategy(ok, outer="published").outer_settings.outer == DelayedNesterov(lr=0.7, momentum=0.9)



def test_a_checkpoint_without_a_lineage_is_refused_naming_the_key_and_what_to_do(tmp_path):
    """A development build's checkpoint (no lineage) cannot resume: a fresh lineage would hide a split brain."""
    strategy = TorchFTStrategy(TorchFT(lighthouse="http://localhost:29510", min_replicas=2))
    round_state = {"global_model": torch.zeros(2), "outer": {"state": {}, "param_groups": []}}
    old, new = tmp_path / "old.ckpt", tmp_path / "new.ckpt"
    torch.save({"torchft": {"round": round_state, "manager": {}}}, old)
    torch.save({"torchft": {"round": {**round_state, "lineage": 7}, "manager": {}}}, new)
    with pytest.raises(ValueError, match=r"old.ckpt holds no `torchft` -> `round` -> `lineage`.*development build.*"
                                         r"Resume from a checkpoint this version wrote, or start the run afresh"):
        strategy.load_checkpoint(old)
    assert strategy.load_checkpoint(new)["torchft"]["round"]["lineage"] == 7


def test_the_heartbeat_interval_written_is_the_one_torchft_runs(monkeypatch):
    """torchft's own 0.1 s heartbeat costs CPU on every step; the job's interval is ``heartbeat_s`` (0.5 s unless
    written), refused where not positive."""
    import torchft

    made = {}
    monkeypatch.setattr(torchft, "Manager", lambda **kwargs: made.update(kwargs) or FakeManager())
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda timeout: None)
    for ft, seconds in ((TorchFT(lighthouse="http://h:1", min_replicas=2), 0.5),
                        (TorchFT(lighthouse="http://h:1", min_replicas=2, heartbeat_s=0.25), 0.25)):
        ft.connect(0, 1, "localhost", 1)
        assert made["heartbeat_interval"] == timedelta(seconds=seconds)
        assert made["max_retries"] is None  # the strategy counts discarded rounds, whatever the cause
    with pytest.raises(ValueError, match="`heartbeat_s` must be"):
        TorchFT(lighthouse="http://h:1", min_replicas=1, heartbeat_s=0)


def test_a_torchft_whose_manager_lacks_the_failed_quorum_attribute_is_refused_when_the_job_connects(monkeypatch):
    """A job left out of a round's end resets torchft 0.2.0's private ``Manager._quorum_future``; a torchft without
    it would have the job die a round later with a re-raised TimeoutError. Connecting refuses it at once, naming
    both releases and the fix, and shuts the manager down (its heartbeats stop)."""
    import torchft

    from lightning_hdet.torchft import settings

    class Renamed(FakeManager):  # a later torchft that renamed the attribute
        def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__()
            del self._quorum_future
            self.shut = False

        def shutdown(self, wait: bool = True) -> None:
            self.shut = True

    made: list[Renamed] = []
    monkeypatch.setattr(torchft, "Manager", lambda **kwargs: made.append(Renamed()) or made[-1])
    monkeypatch.setattr(torchft, "ProcessGroupGloo", lambda timeout: None)
    monkeypatch.setattr(settings, "version", lambda name: "0.3.0")
    with pytest.raises(RuntimeError, match=r"supports torchft 0\.2\.0, and the installed torchft is 0\.3\.0.*"
                                           r"`pip install torchft==0\.2\.0`"):
        TorchFT(lighthouse="http://h:1", min_replicas=2).connect(0, 1, "localhost", 1)
    assert made[0].shut


class PeersManager(FakeManager):
    """The manager of a job among peers that train the run's ``rounds`` on time: at each round's end they commit it
    (``peers_step``) with a pseudo-gradient of [1, 1]; this job is late at the ends of ``late_rounds`` (the run's
    round numbers). The peers start their next round before a job left out is back, which meets them at the start of
    the one after and heals to it there (only the round: the model is this test's concern at the run's end); where
    no round is left, no quorum forms: torchft's TimeoutError, after its quorum timeout (``alone``: min_replicas=1,
    the Lighthouse forms a quorum of this job alone). ``failed_ends``: round ends where a peer fails, so no one
    commits; ``ahead``: rounds the peers train while a job left out waits."""

    def __init__(self, rounds: int, late_rounds: set[int], failed_ends: frozenset[int] = frozenset(),
                 ahead: int = 1, alone: bool = False) -> None:
        super().__init__(peers=[[1.0, 1.0, 1.0]])
        self.ahead, self.alone, self.jobs = ahead, alone, 2
        self.rounds, self.late_rounds, self.step, self.peers_step = rounds, late_rounds, 0, 0
        self.failed_ends, self.ends = failed_ends, 0  # round ends (counted from 0) where a peer fails: no one commits

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: timedelta | None = None) -> None:
        if shrink_only:
            failed, self.ends = self.ends in self.failed_ends, self.ends + 1
            self.late = not failed and self.step in self.late_rounds
            self.late_rounds = self.late_rounds - {self.step} if self.late else self.late_rounds  # late once a round
            self.peers_step, self.commit = self.step + (not failed), not failed
        elif self.step < self.peers_step:  # left out: the peers trained ``ahead`` more rounds meanwhile
            self.peers_step += self.ahead
            if self.peers_step < self.rounds:
                self.step = self.peers_step
            elif self.alone:  # the peers ended; min_replicas=1: a quorum of this job alone, nothing to heal from
                self.jobs = 1
            else:
                raise TimeoutError("no quorum within quorum_timeout: the other jobs ended")
        super().start_quorum(allow_heal, shrink_only, timeout)

    def should_commit(self) -> bool:
        self.step += self.commit
        return self.commit

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.jobs

    def shutdown(self, wait: bool = True) -> None:
        pass


class StandStill(pl.LightningModule):
    """Inner steps at LR 0 (each round's pseudo-gradient is zero) on w = [1, 2]: each committed round the mean is
    [0.5, 0.5] and the outer step (Nesterov, lr 1, momentum 0) moves w by -0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.net = linear([1.0, 2.0])

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.net(batch).sum()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return torch.utils.data.DataLoader(torch.ones(64, 2), batch_size=2)


def fit_among_peers(monkeypatch, manager: PeersManager, **torchft) -> tuple[TorchFTStrategy, pl.Trainer, nn.Module]:
    """One job of one process (Lightning's DDP over gloo) whose rounds of 2 steps run against ``manager``."""
    monkeypatch.setattr(TorchFT, "connect", lambda self, *args: manager)
    strategy = TorchFTStrategy(TorchFT(lighthouse="http://h:1", min_replicas=2, **torchft), local_steps=2,
                               outer=Nesterov(lr=1.0, momentum=0.0), check_pushes=False, process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2 * manager.rounds, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = StandStill()
    trainer.fit(module)
    return strategy, trainer, module


@pytest.mark.parametrize(("late", "w", "steps"), [(3, [-0.5, 0.5], 8), (2, [0.0, 1.0], 6)])
def test_a_job_left_out_of_one_of_the_run_s_last_two_rounds_ends_there_with_the_global_model_it_holds(
        monkeypatch, caplog, late, w, steps):
    """Four rounds; the job is late only at the end of round ``late``, the last (3) or the one before (2: the peers
    start round 3 without it and end after it). The rounds before commit: w = [1, 2] - 0.5 each. Round ``late`` is
    discarded and the job ends there, without another quorum (one would wait out ``quorum_timeout`` for peers that
    ended, and fail), and says so; the peers end ``4 - late`` outer steps further."""
    manager = PeersManager(rounds=4, late_rounds={late})
    strategy, trainer, module = fit_among_peers(monkeypatch, manager)
    assert torch.equal(module.net.weight, torch.tensor([w]))
    assert (strategy.round, strategy.rounds_committed, strategy.rounds_discarded) == (late, late, 1)
    assert strategy.ended_behind and trainer.global_step == steps
    assert manager.calls[-2:] == ["quorum", "shrink-only quorum"]  # nothing after that round's end
    assert f"it ends now, holding the global model of that round's start, {4 - late} outer step(s) before" in caplog.text


def test_a_job_left_out_of_rounds_now_and_then_heals_and_trains_on(monkeypatch):
    """Eight rounds, ``max_discarded_rounds=3``; late at the ends of rounds 0, 2 and 5 (the run's rounds). Round 0 is
    left out, the job heals to round 2 (the peers trained 1 meanwhile); round 2 left out (two in a row), heal to 4;
    4 commits (the count starts again); 5 left out, heal to 7; 7 commits and ends the run: 3 discarded, 2
    committed, 3 heals, five rounds trained (10 steps); w = [1, 2] - 2 x 0.5 (a heal here brings the round, not the
    peers' model)."""
    strategy, trainer, module = fit_among_peers(monkeypatch, PeersManager(rounds=8, late_rounds={0, 2, 5}),
                                                max_discarded_rounds=3)
    assert (strategy.round, strategy.rounds_committed, strategy.rounds_discarded, strategy.healed) == (8, 2, 3, 3)
    assert not strategy.ended_behind and trainer.global_step == 10
    assert torch.equal(module.net.weight, torch.tensor([[0.0, 1.0]]))


def test_a_job_left_out_of_max_discarded_rounds_in_a_row_ends_with_an_error_naming_the_fix(monkeypatch):
    """Ten rounds, ``max_discarded_rounds=3``, late at every round's end: rounds 0 and 2 are left out (each heals to
    the round after next), round 4 is the third in a row: the job stops after 6 steps, having committed none."""
    manager = PeersManager(rounds=10, late_rounds=set(range(10)))
    with pytest.raises(RuntimeError, match=r"discarded 3 rounds in a row \(`TorchFT\(max_discarded_rounds=3\)`\), "
                                           r"the last because this job was left out of its end.*--join_timeout_ms "
                                           r"above this job's lag, or check this node"):
        fit_among_peers(monkeypatch, manager, max_discarded_rounds=3)
    assert manager.step == 4 and manager.calls.count("shrink-only quorum") == 3 and "allreduce" not in manager.calls


def test_rounds_left_out_and_not_committed_in_turn_count_as_one_streak_of_discarded_rounds(monkeypatch):
    """``max_discarded_rounds=3``: the job is left out at the end of round 0 (heals to 2), a peer fails during round
    2 (torchft does not commit it; trained again) and the job is left out of round 2's end once more: three rounds
    in a row that did not commit, the last left out. Before, each cause had its own count, reset by the other (and
    torchft's own ``max_retries`` counted only the rounds not committed), so alternating causes never stopped."""
    manager = PeersManager(rounds=10, late_rounds={0, 2}, failed_ends=frozenset({1}))
    with pytest.raises(RuntimeError, match=r"discarded 3 rounds in a row \(`TorchFT\(max_discarded_rounds=3\)`\), "
                                           r"the last because this job was left out of its end"):
        fit_among_peers(monkeypatch, manager, max_discarded_rounds=3)
    assert manager.step == 2 and manager.calls.count("shrink-only quorum") == 3
    assert manager.calls.count("allreduce") == 1


def test_a_streak_of_rounds_not_committed_ends_the_job_naming_the_cause(monkeypatch):
    """``max_discarded_rounds=2``; a peer fails during round 1's first two tries: neither commits, the job stops
    with the count and the cause (torchft itself no longer counts: ``max_retries=None``)."""
    manager = PeersManager(rounds=4, late_rounds=set(), failed_ends=frozenset({1, 2}))
    with pytest.raises(RuntimeError, match=r"discarded 2 rounds in a row .*the last because torchft did not commit it "
                                           r"\(a job failed during it"):
        fit_among_peers(monkeypatch, manager, max_discarded_rounds=2)
    assert manager.step == 1 and manager.calls.count("allreduce") == 3


def test_a_job_left_out_whose_next_quorum_holds_none_of_the_jobs_ahead_ends_there_instead_of_training_apart(
        monkeypatch, caplog):
    """Eight rounds; the job is left out of round 1's end, and the peers (rounds far shorter than its wait) finish
    the run meanwhile. With min_replicas=1 its next quorum holds it alone, at round 1: no heal, 1 job of the round's
    2. Before, it trained rounds 1-7 alone and ended at round 8 with a model apart from the peers' under the same
    round number, silently. Now it ends there: round 0 committed (w = [1, 2] - 0.5), round 1 discarded, 4 steps."""
    manager = PeersManager(rounds=8, late_rounds={1}, ahead=7, alone=True)
    strategy, trainer, module = fit_among_peers(monkeypatch, manager)
    assert (strategy.round, strategy.rounds_committed, strategy.rounds_discarded, strategy.healed) == (1, 1, 1, 0)
    assert strategy.ended_behind and trainer.global_step == 4
    assert torch.equal(module.net.weight, torch.tensor([[0.5, 1.5]]))
    assert "its next quorum neither healed it nor held the 2 jobs of that round (1 now)" in caplog.text
