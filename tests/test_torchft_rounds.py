"""DiLoCo on torchft in one process: a job's rounds (lightning_hdet/torchft/rounds.py) against a fake torchft
``Manager`` whose allreduce adds the other jobs' contributions; the settings' and the strategy's checks. Values are
computed by hand in the comments."""

from __future__ import annotations

import math
from concurrent.futures import Future
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import ReduceOp

from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, DelayedNesterovOptimizer, Nesterov
from lightning_hdet.torchft import TorchFT, TorchFTStrategy
from lightning_hdet.torchft.rounds import STATE_KEY, ReplicaRound

CPU = torch.device("cpu")


class FakeManager:
    """torchft's Manager as a round uses it: ``allreduce`` (SUM) adds ``peers``' wire vectors to this job's and
    keeps what this job sent; ``should_commit`` answers ``commit``; ``start_quorum`` heals with ``heal_from``'s
    state when set and allowed (as torchft does for a job behind); ``late``: the round-end quorum is formed without
    this job (its wait times out); ``calls``: what was called, in order."""

    def __init__(self, peers: list[list[float]] = (), commit: bool = True) -> None:
        self.peers, self.commit = [torch.tensor(p) for p in peers], commit
        self.sent: list[torch.Tensor] = []
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
        self.sent.append(tensor.clone())
        for p in self.peers:
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
    for job in (new, peer):  # the same next round: the same model after it (the momentum came along)
        trained(job.module, (job.global_model - 1.0).tolist())
        job.finish()
    assert torch.equal(module.weight, live_module.weight)


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
    manager.late, manager.heal_from = False, {"global_model": torch.tensor([5.0, 6.0]),
                                              "outer": nesterov(torch.zeros(2)).state_dict()}
    ft.start()
    assert torch.equal(module.weight, torch.tensor([[5.0, 6.0]]))
    trained(module, [4.0, 5.0])  # pseudo-gradient [1, 1], the peer's too: 1.33 [1, 1] from [5, 6]
    assert ft.finish().committed
    assert torch.allclose(module.weight, torch.tensor([[5.0 - 1.33, 6.0 - 1.33]]))


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
    with pytest.raises(ValueError, match="`heartbeat_s` must be"):
        TorchFT(lighthouse="http://h:1", min_replicas=1, heartbeat_s=0)


def test_a_torchft_whose_manager_lacks_the_failed_quorum_attribute_is_refused_when_the_job_connects(monkeypatch):
    """A job left out of a round's end resets torchft 0.2.0's private ``Manager._quorum_future``; a torchft without
    it would have the job die a round later with a re-raised TimeoutError. Connecting refuses it at once, naming
    both releases and the fix, and shuts the manager down (its heartbeats stop)."""
    import torchft

    import lightning_hdet.torchft.settings as settings

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
