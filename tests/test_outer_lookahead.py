"""The outer lr picked by a one-step lookahead (``DelayedNesterov(lookahead=LookaheadLR(...))``): the pure rule in
one process with a hand-written score, its refusals, and the Lightning score on a module's own validation_step."""

import math

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hdet import AsyncLocalSGDFabricStrategy, AsyncLocalSGDStrategy, LookaheadLR, WorkerShape
from lightning_hdet._compat import validation_loaders
from lightning_hdet.asynchronous.elastic.service import elastic_settings
from lightning_hdet.asynchronous.lightning.local_metrics import make_metrics_local, restore
from lightning_hdet.asynchronous.lightning.validation_score import ValidationScore, validation_score
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.messages import Kind, Push
from tests.test_async_local_sgd import Regression, _fit, _rows


def _state(mode, outer, score=None, workers=2, params=(1.0, 1.0), ranges=None):
    settings = OuterSettings(mode=mode, local_steps=10, outer=outer, check_pushes=False)
    return settings.build(torch.tensor(params), torch.zeros(0), workers, None, ranges, score=score)


def _push(worker, g):
    return Push(worker, Kind.PUSH, 10, 1.0, 0.0, torch.tensor(g))


def _to(target):
    """The squared distance of the parameters to ``target``: a score whose best lr is known by hand."""
    return lambda params, buffers: float(((params - torch.tensor(target)) ** 2).sum())


def test_diloco_round_takes_the_candidate_lr_that_scores_best_and_the_lr_walks_from_there():
    outer = DelayedNesterov(lr=0.4, momentum=0.0, lookahead=LookaheadLR(low=0.1, high=1.0))
    state = _state("sync", outer, _to([0.2, 0.2]))
    state.process([_push(0, [0.5, 1.5]), _push(1, [1.5, 0.5])])  # mean [1, 1]
    # candidates 0.2 / 0.4 / 0.8 move 1.0 to 0.8 / 0.6 / 0.2: squared distances 0.72 / 0.32 / 0
    assert state.lookahead.scores == pytest.approx([0.72, 0.32, 0.0])
    torch.testing.assert_close(state.params, torch.tensor([0.2, 0.2]))
    assert state.optimizer.param_groups[0]["lr"] == 0.8
    state.process([_push(0, [1.0, 1.0]), _push(1, [1.0, 1.0])])
    # from 0.8: 0.4 / 0.8 / 1.0 (2 x 0.8 clipped to high): 0.2 -> -0.2 / -0.6 / -0.8, distances 0.32 / 1.28 / 2.0
    assert state.lookahead.scores == pytest.approx([0.32, 1.28, 2.0])
    assert state.optimizer.param_groups[0]["lr"] == 0.4
    torch.testing.assert_close(state.params, torch.tensor([-0.2, -0.2]))
    assert state.metrics()["async/outer_lr"] == 0.4


def test_a_tie_and_non_finite_scores_keep_the_current_lr():
    for score in (lambda p, b: 1.0, lambda p, b: math.nan):
        state = _state("sync", DelayedNesterov(lr=0.5, momentum=0.0, lookahead=LookaheadLR()), score)
        state.process([_push(0, [1.0, 1.0]), _push(1, [1.0, 1.0])])
        assert state.optimizer.param_groups[0]["lr"] == 0.5
        torch.testing.assert_close(state.params, torch.tensor([0.5, 0.5]))


def test_async_candidates_are_undone_exactly_momentum_included():
    """Each push under the lookahead ends where a plain Delayed Nesterov at the lr it picked ends: the rejected
    candidates leave nothing behind, not the momentum buffer they created, not a push count."""
    options = dict(momentum=0.5, warmup=2, restarts=0)
    looked = _state("async", DelayedNesterov(lr=0.4, **options, lookahead=LookaheadLR()), _to([-3.0, 2.0]))
    plain = _state("async", DelayedNesterov(lr=0.4, **options))
    pushes = [(0, [1.0, -0.5]), (1, [0.8, -0.2]), (0, [0.6, -0.7]), (1, [1.2, 0.1]), (0, [0.9, -0.3])]
    lrs = []
    for worker, g in pushes:
        looked.process([_push(worker, g)])
        lrs.append(looked.optimizer.param_groups[0]["lr"])
        plain.optimizer.param_groups[0]["lr"] = lrs[-1]
        plain.process([_push(worker, g)])
        assert torch.equal(looked.params, plain.params)
        for p, q in zip(looked.views, plain.views):
            assert looked.optimizer.state[p].keys() == plain.optimizer.state[q].keys()
            for key, value in looked.optimizer.state[p].items():
                other = plain.optimizer.state[q][key]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    assert len(set(lrs)) > 1  # the lr moved: the test saw more than one candidate win


def test_an_async_push_in_fragments_is_applied_whole_once_every_fragment_arrived():
    state = _state("async", DelayedNesterov(lr=0.5, momentum=0.0, lookahead=LookaheadLR()), _to([0.0, 0.0, 0.0]),
                   workers=1, params=(1.0, 1.0, 1.0), ranges=[(0, 1), (1, 3)])  # one worker: N = 1
    start = state.params.clone()

    def fragments():
        yield torch.tensor([1.0])
        assert torch.equal(state.params, start)  # the first fragment waits for the lookahead
        yield torch.tensor([1.0, 1.0])

    state.receive(Push(0, Kind.PUSH, 10, 1.0, 0.0, None), fragments())
    # candidates 0.25 / 0.5 / 1.0: 1 - lr per value, distances 3 x 0.5625 / 0.25 / 0: lr 1.0
    torch.testing.assert_close(state.params, torch.zeros(3))
    assert state.outer_updates == 1


def test_a_stream_that_reuses_one_buffer_for_every_fragment_is_staged_as_it_was():
    """A decoder writes each fragment into the same buffer (``Layout.decode``): the staged push keeps copies."""
    state = _state("async", DelayedNesterov(lr=0.5, momentum=0.0, lookahead=LookaheadLR()), _to([0.0, 0.0]),
                   workers=1, ranges=[(0, 1), (1, 2)])
    buffer = torch.empty(1)

    def fragments():
        for value in (1.0, 3.0):
            buffer.fill_(value)
            yield buffer

    state.receive(Push(0, Kind.PUSH, 10, 1.0, 0.0, None), fragments())
    # candidates [1 - lr, 1 - 3 lr]: lr 0.25 -> [0.75, 0.25], distance 0.625; 0.5 -> [0.5, -0.5], 0.5; 1.0 ->
    # [0, -2], 4: lr 0.5 (had the stage kept the buffer, both fragments would read 3.0)
    torch.testing.assert_close(state.params, torch.tensor([0.5, -0.5]))


def test_a_score_that_raises_leaves_the_model_and_the_lr_as_they_were():
    def failing(params, buffers):
        raise RuntimeError("out of memory")

    state = _state("sync", DelayedNesterov(lr=0.4, momentum=0.5, lookahead=LookaheadLR()), failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        state.process([_push(0, [1.0, 1.0]), _push(1, [1.0, 1.0])])
    torch.testing.assert_close(state.params, torch.tensor([1.0, 1.0]))
    assert state.optimizer.param_groups[0]["lr"] == 0.4 and not state.optimizer.state


def test_a_heavy_momentum_with_a_lookahead_warns_naming_what_was_measured():
    with pytest.warns(UserWarning, match="measured stable at momentum 0.5 and rising at 0.9"):
        DelayedNesterov(lr=0.375, momentum=0.9, lookahead=LookaheadLR())


def test_the_walked_lr_travels_in_the_checkpoint():
    outer = DelayedNesterov(lr=0.4, momentum=0.0, lookahead=LookaheadLR())
    state = _state("sync", outer, _to([0.2, 0.2]))
    state.process([_push(0, [1.0, 1.0]), _push(1, [1.0, 1.0])])
    resumed = _state("sync", outer, _to([0.2, 0.2]))
    resumed.load_state_dict(state.state_dict())
    assert resumed.optimizer.param_groups[0]["lr"] == 0.8


@pytest.mark.parametrize("kwargs, match", [
    (dict(monitor=""), "`monitor` must be the name of a metric"),
    (dict(batches=0), "`batches` must be a positive integer"),
    (dict(mode="lower"), "`mode` must be one of"),
    (dict(low=0.0), "`low` must be"),
    (dict(low=0.5, high=0.2), "`high` must be a finite number >= 0.5"),
    (dict(bacthes=2), "Did you mean `batches`"),
])
def test_lookahead_options_are_checked(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LookaheadLR(**kwargs)


def test_refused_where_nothing_can_score_or_the_lr_lies_outside_the_range():
    with pytest.raises(ValueError, match=r"`lr` must be within the lookahead's \[low, high\] = \[0.1, 1\], got 2"):
        DelayedNesterov(lr=2.0, lookahead=LookaheadLR())
    with pytest.raises(ValueError, match="`lookahead` must be a LookaheadLR"):
        DelayedNesterov(lr=0.5, lookahead="on")
    outer = DelayedNesterov(lr=0.375, momentum=0.5, lookahead=LookaheadLR())
    with pytest.raises(ValueError, match="`lookahead` needs a score"):
        _state("sync", outer)
    with pytest.raises(ValueError, match="without lookahead with an elastic service"):
        elastic_settings("none", "none", {"outer": outer})
    with pytest.raises(ValueError, match="without lookahead with Fabric"):
        AsyncLocalSGDFabricStrategy(outer=outer)
    with pytest.raises(ValueError, match="without lookahead with FSDP inside a worker"):
        AsyncLocalSGDStrategy(outer=outer, worker=WorkerShape(ranks_per_worker=2, inside_worker="fsdp"))
    config = AsyncLocalSGDStrategy(outer=outer).config
    assert {k: v for k, v in config.items() if k.startswith("outer/lookahead")} == {
        "outer/lookahead/monitor": "val_loss", "outer/lookahead/mode": "min", "outer/lookahead/batches": 8,
        "outer/lookahead/low": 0.1, "outer/lookahead/high": 1.0}


class Line(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log_dict({"val_mse": nn.functional.mse_loss(self.layer(x), y), "other": 1.0})


class MetricLine(Line):
    """Logs a torchmetrics object, as many modules do: its value per batch counts, not its running mean."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = torchmetrics.MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.mse(self.layer(x), y)
        self.log("val_mse", self.mse)


def test_the_lightning_score_is_the_mean_of_what_validation_step_logs_with_the_given_weights():
    batches = [(torch.tensor([[1.0], [2.0]]), torch.tensor([[1.0], [1.0]])),
               (torch.tensor([[0.0]]), torch.tensor([[3.0]]))]
    score = ValidationScore(Line(), batches, "val_mse", torch.device("cpu"))
    # y = 2x + 1: batch 1 predicts 3, 5 for 1, 1 -> mse (4 + 16) / 2 = 10; batch 2 predicts 1 for 3 -> 4
    assert score(torch.tensor([2.0, 1.0]), torch.zeros(0)) == pytest.approx((10.0 + 4.0) / 2)
    metric = ValidationScore(MetricLine(), batches, "val_mse", torch.device("cpu"))
    assert metric(torch.tensor([2.0, 1.0]), torch.zeros(0)) == pytest.approx(7.0)  # per batch: 10 and 4, not 8
    higher = ValidationScore(Line(), batches, "val_mse", torch.device("cpu"), mode="max")
    assert higher(torch.tensor([2.0, 1.0]), torch.zeros(0)) == pytest.approx(-7.0)  # the lookahead keeps the lowest
    missing = ValidationScore(Line(), batches, "val_loss", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"did not log 'val_loss' \(it logged \['other', 'val_mse'\]\)"):
        missing(torch.tensor([2.0, 1.0]), torch.zeros(0))


@pytest.mark.timeout(180)
def test_diloco_with_a_lookahead_scores_on_rank_0s_validation_data_and_logs_its_lr(tmp_path):
    """Two processes (gloo): rank 0 scores each round's candidates with the module's own validation_step; every
    logged outer lr is one the walk from 0.375 can reach, and the checkpointable outer state holds the last."""
    seed_everything(0)
    outer = DelayedNesterov(lr=0.375, momentum=0.5, lookahead=LookaheadLR(batches=2))
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode="sync", outer=outer, start_method="fork")
    ranks = _fit(tmp_path, Regression(), strategy, devices=2, max_steps=24, val_check_interval=8)
    lrs = [row["async/outer_lr"] for row in _rows(tmp_path) if "async/outer_lr" in row]
    walk = [0.375, *lrs]  # each logged lr is the one before times 0.5, 1 or 2, within [0.1, 1]
    assert lrs and all(any(b == min(1.0, max(0.1, a * s)) for s in (0.5, 1.0, 2.0)) for a, b in zip(walk, walk[1:]))
    assert len(set(lrs)) > 1, lrs  # the candidates were scored: the lr moved
    assert ranks[0]["outer"]["optimizer"]["param_groups"][0]["lr"] == lrs[-1]
    assert ranks[0]["val_losses"][-1] < ranks[0]["val_losses"][0]


class MetricRegression(Regression):
    """Logs its validation loss through a torchmetrics object too, as many modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.val_mse = torchmetrics.MeanSquaredError()

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        x, y = batch
        self.val_mse(self.layer(x), y)
        self.log("val_mse", self.val_mse)


@pytest.mark.timeout(180)
def test_async_with_a_lookahead_on_a_torchmetrics_monitor_walks_its_lr_without_waiting_on_other_ranks(tmp_path):
    """Two processes, async: rank 0 scores every push (its own in its training thread, the other's where it is
    received) through a torchmetrics object, which would sync over the world group if the copy let it: the run
    would hang there. Each logged lr is one the walk from 0.375 can reach (pushes land between rank 0's logs, so
    several steps of it may lie between two logged values)."""
    seed_everything(0)
    outer = DelayedNesterov(lr=0.375, momentum=0.5, warmup=16, restarts=8,
                            lookahead=LookaheadLR(monitor="val_mse", batches=2))
    strategy = AsyncLocalSGDStrategy(local_steps=4, mode="async", outer=outer, start_method="fork")
    ranks = _fit(tmp_path, MetricRegression(), strategy, devices=2, max_steps=24, val_check_interval=8)
    lrs = [row["async/outer_lr"] for row in _rows(tmp_path) if "async/outer_lr" in row]
    reachable, frontier = {0.375}, [0.375]
    while frontier:
        a = frontier.pop()
        for b in (min(1.0, max(0.1, a * s)) for s in (0.5, 2.0)):
            if b not in reachable:
                reachable.add(b)
                frontier.append(b)
    assert lrs and set(lrs) <= reachable, lrs
    assert ranks[0]["outer"]["outer_updates"] >= 10
    assert ranks[0]["val_losses"][-1] < ranks[0]["val_losses"][0]


def test_metrics_made_local_while_training_apart_sync_again_afterwards():
    module = MetricRegression()
    original = module.val_mse.distributed_available_fn
    saved = make_metrics_local(module)
    assert list(saved) == [module.val_mse] and module.val_mse.distributed_available_fn() is False
    assert make_metrics_local(module) == {}  # twice: the first switch is what restore puts back
    restore(saved)
    assert module.val_mse.distributed_available_fn is original


def test_validation_loaders_are_set_up_when_the_first_epoch_does_not_validate(tmp_path):
    """check_val_every_n_epoch=2 without a sanity check: at on_train_start the fit loop has not set up validation
    (val_dataloaders is None); the lookahead's loaders are then set up as the fit loop would."""
    seen = {}

    class Look(Callback):
        def on_train_start(self, trainer, pl_module):
            seen["before"] = trainer.val_dataloaders
            seen["loaders"] = validation_loaders(trainer)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, check_val_every_n_epoch=2, num_sanity_val_steps=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=[Look()])
    trainer.fit(Regression())
    assert seen["before"] is None
    assert len(seen["loaders"]) == 1 and len(next(iter(seen["loaders"][0]))[0]) == 16  # its batches of 16


class FittedLine(Line):
    """:class:`Line` with no data hooks: the fit is given its data."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lookahead_without_validation_data_is_refused_naming_the_fix(tmp_path):
    """A fit given no validation data: Lightning's own error ("`val_dataloader` must be implemented") named neither
    the lookahead nor the fix; with validation data the score is built."""
    outcomes = []

    class Score(Callback):
        def on_train_start(self, trainer, pl_module):
            try:
                outcomes.append(validation_score(pl_module, LookaheadLR(monitor="val_mse"), torch.device("cpu"),
                                                 lambda batch: batch))
            except ValueError as err:
                outcomes.append(str(err))

    data = DataLoader(TensorDataset(torch.randn(8, 1), torch.randn(8, 1)), batch_size=4)
    for val in (None, data):
        Trainer(accelerator="cpu", devices=1, max_steps=1, num_sanity_val_steps=0, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=tmp_path, callbacks=[Score()]).fit(FittedLine(), data, val)
    refusal, score = outcomes
    assert "`lookahead` scores candidate outer lrs on your validation data" in refusal
    assert "give the Trainer one val_dataloader (got 0)" in refusal
    assert isinstance(score, ValidationScore)
