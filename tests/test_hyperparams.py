"""Exploring more than the LR (``HDETStrategy(explore=...)``): the checks, the per-step scaling, the votes, the
checkpoint and the replay of the other hyperparameters, in one process against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_hdet import Best, HDETCallback, HDETReplay, HDETStrategy, LRTrajectory, Search, Softmax
from lightning_hdet.hdet.execution.fake import FakeWorld
from lightning_hdet.hdet.hyperparams import Explored, ExploredTables, check_explore, check_optimizers, scaled
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.records.wandb import vote_rows
from lightning_hdet.replay import ReplayHooks
from tests.helpers import START, Recorder, SGDBoring, load_ranks, make_scheduler, quiet_trainer

WD = "weight_decay"


# ------------------------------------------------------------------ the argument
@pytest.mark.parametrize("explore, kwargs, match", [
    ({WD: 1.0}, {}, r"`explore\['weight_decay'\]` must be a span.* > 1, got 1.0. A span of 1 explores nothing"),
    ({WD: 0.0}, {}, r"`explore\['weight_decay'\]` must be a span"),
    ({WD: [1.0, 0.0]}, {}, r"one positive multiplier per group"),
    ({WD: [1.0, 2.0, 3.0]}, {"num_groups": 2}, r"one positive multiplier per group"),
    ({"betas": 4.0}, {}, r"'beta1', 'beta2'"),
    ({}, {}, r"`explore` must be None or a non-empty dict"),
    ({WD: 4.0}, {"num_groups": 1}, r"`num_groups` must be None or at least 2 with explore=\{'weight_decay': 4.0\}"),
    ({"lr": 9.0}, {"spread": 0.1}, r"`lr_multipliers` must be None with explore\['lr'\]"),
    ({"lr": 0.5}, {}, r">= 1 \(1.0: the LR is not explored\)"),
])
def test_bad_explore_is_refused_before_any_process(explore: dict, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HDETStrategy(explore=explore, **kwargs)


def test_the_grids_start_out_of_step_with_the_lrs() -> None:
    """A span gives the LR's geometric grid; the group at the LR's 1 keeps 1 (the user's set-up trains), the k-th
    hyperparameter after the LR rotates the other values k groups further on."""
    grid = [27 ** (g / 4 - 0.25) for g in range(4)]  # span_grid(4, 27): the LR's 1 in group 1
    tables = ExploredTables(check_explore({WD: 27.0, "beta2": [1.0, 2.0, 3.0, 4.0]}, 4, False), 4).get(1)
    assert tables[WD][:, 0].tolist() == pytest.approx([grid[2], grid[1], grid[3], grid[0]])
    assert tables["beta2"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # a list: as given
    assert ExploredTables({"lr": 1.0, WD: 4.0}, 2).lr is False


def test_optimizers_that_cannot_explore_a_name_are_refused() -> None:
    w = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(ValueError, match=r"optimizer 0 \(Adam\) param group 0 has momentum=None; allowed names: .*"
                                         r"'weight_decay'.*'beta1', 'beta2'"):
        check_optimizers([torch.optim.Adam(w, weight_decay=0.1)], ["momentum"])
    with pytest.raises(ValueError, match=r"has weight_decy=None; .*\. Did you mean 'weight_decay'\?$"):
        check_optimizers([torch.optim.Adam(w, weight_decay=0.1)], ["weight_decy"])
    with pytest.raises(ValueError, match=r"weight_decay=0.*cannot explore \(allowed: non-zero\)"):
        check_optimizers([torch.optim.SGD(w, lr=0.1)], [WD])
    with pytest.raises(ValueError, match=r"momentum=0.*\(allowed: in \(0, 1\)\)"):
        check_optimizers([torch.optim.SGD(w, lr=0.1, weight_decay=0.1)], ["momentum"])
    check_optimizers([torch.optim.AdamW(w), torch.optim.SGD(w, lr=0.1, momentum=0.9, weight_decay=0.1)], [WD, "lr"])


# ------------------------------------------------------------------ the step
def test_a_step_sees_the_group_values_and_the_optimizer_keeps_its_own() -> None:
    p = torch.nn.Parameter(torch.tensor([2.0]))
    sgd = torch.optim.SGD([p], lr=0.5, weight_decay=0.1, momentum=0.9)
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))], betas=(0.9, 0.99))
    with scaled(sgd, {WD: [3.0], "momentum": [2.0]}), scaled(adam, {"beta2": [10.0], "beta1": [0.5]}):
        assert sgd.param_groups[0][WD] == pytest.approx(0.3)
        assert sgd.param_groups[0]["momentum"] == pytest.approx(0.8)  # 1 - (1 - 0.9) * 2: half the horizon
        assert adam.param_groups[0]["betas"] == pytest.approx((0.95, 0.9))
        p.grad = torch.tensor([1.0])
        sgd.step()
    assert sgd.param_groups[0][WD] == 0.1 and sgd.param_groups[0]["momentum"] == 0.9
    assert adam.param_groups[0]["betas"] == (0.9, 0.99)
    assert p.item() == pytest.approx(2.0 - 0.5 * (1.0 + 0.3 * 2.0))  # the step decayed by 0.3, not 0.1
    with scaled(sgd, {"momentum": [20.0]}):
        assert sgd.param_groups[0]["momentum"] == 0.0  # 1 - 0.1 * 20 < 0: no momentum, never negative


# ------------------------------------------------------------------ the votes
def _interval(lr_explored: bool) -> Interval:
    explored = Explored({WD: torch.tensor([[0.5], [2.0]], dtype=torch.float64)}, {WD: [0.01]}, lr_explored)
    return Interval(step=10, losses=[1.0, 2.0], finite=[True, True],
                    multipliers=torch.tensor([[0.5], [2.0]], dtype=torch.float64), schedule_lrs=[0.1],
                    shared_gradients=False, explored=explored)


@pytest.mark.parametrize("lr_explored", [True, False])
def test_softmax_moves_the_weight_decay_as_it_moves_the_lr(lr_explored: bool) -> None:
    """The published controller, by hand, on the weight-decay column: values 0.01 x [0.5, 2], losses [1, 2]."""
    controller = HDETController(HDETConfig(vote=Softmax(permute=False), safety_net=None))
    decision = controller.decide(_interval(lr_explored))
    w0 = 1 / (1 + math.exp(-10.0))  # softmax((1.5 - L) / 0.1)
    delta = w0 * 0.005 + (1 - w0) * 0.02 - 0.0125
    new_base = 0.0125 + 0.5 * (0.1 * delta)  # base + meta_lr * (1 - momentum) * delta
    expected = [new_base / 0.01 * s for s in (0.4, 1.6)]  # shape m / mean(m)
    assert decision.explored[WD][:, 0].tolist() == pytest.approx(expected, rel=1e-12)
    assert decision.values[WD] == pytest.approx([0.01 * m for m in expected], rel=1e-12)
    lrs = decision.multipliers[:, 0].tolist()
    assert (lrs == [0.5, 2.0]) is not lr_explored  # explore={"lr": 1.0}: the LR column is left alone
    assert [row["explored"][WD] for row in controller.history] == pytest.approx(decision.values[WD])
    assert controller.rule.state_dict()["velocity"].keys() == {0, 1_000_000}  # one controller per column


def test_the_search_ends_on_the_winners_weight_decay_and_a_rescue_leaves_it_alone() -> None:
    controller = HDETController(HDETConfig(vote=Best(), safety_net=None, search=Search(steps=5, refine_spread=2.0)))
    decision = controller.decide(Interval(**{**_interval(True).__dict__, "refine": True}))
    assert decision.refined and decision.winner == 0
    # A grid of ratio 2 around the winner's 0.5, in the initial order (group g gets the grid's (g + 1) mod 2).
    assert decision.explored[WD][:, 0].tolist() == pytest.approx([0.5 * 2 ** 0.5, 0.5 * 2 ** -0.5])
    rollback = HDETController(HDETConfig(vote=Best())).decide(
        Interval(**{**_interval(True).__dict__, "losses": [float("nan"), float("nan")], "finite": [False, False]}))
    assert rollback.roll_back and rollback.explored[WD][:, 0].tolist() == [0.5, 2.0]
    assert rollback.multipliers[:, 0].tolist() == [0.25, 1.0]  # the safety net cuts the LRs only


def test_the_trust_region_vote_is_refused_with_explore() -> None:
    world = FakeWorld([0.0], [0.5, 2.0], gradient_sync="global", explore={WD: [0.5, 2.0]},
                      explore_values={WD: [0.01]})
    callback = HDETCallback(every_n_steps=2, vote="trust_region", search=False)
    with pytest.raises(ValueError, match=r"`vote` must be not 'trust_region' with explore=\['weight_decay'\]"):
        world.fit(lambda: callback, lambda ex, step: 1.0, max_steps=2)


class _Logger:
    def __init__(self) -> None:
        self.metrics: dict[int, dict[str, float]] = {}
        self.config: dict = {}

    def log_hyperparams(self, params: dict) -> None:
        self.config.update(params)

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.setdefault(step, {}).update(metrics)


def _fit(max_steps: int, save_at=None, resume=None):
    """Two groups of the fake world; each group's loss is how far its weight decay is from 0.02."""
    world = FakeWorld([0.0], [1.0, 1.0], explore={WD: [0.5, 4.0], "lr": 1.0}, explore_values={WD: [0.01]})

    def train_step(executor, step: int) -> float:
        return abs(math.log(0.01 * float(executor.explored.tables[WD][executor.group_index, 0]) / 0.02)) + 1.0

    logger = _Logger()
    runs = world.fit(lambda: HDETCallback(every_n_steps=2, search=False, safety_net=False), train_step, max_steps,
                     save_at=save_at, resume=resume, loggers=[logger], log_every_n_steps=1)
    return world, runs, logger


def test_pbt_moves_the_weight_decay_logs_it_and_a_resume_continues_exactly() -> None:
    world, runs, logger = _fit(8, save_at=4)
    history = runs[0][0].history
    values = [0.005, 0.04]  # 0.01 x [0.5, 4]
    for step in (2, 4, 6, 8):
        winner = min(range(2), key=lambda g: abs(math.log(values[g] / 0.02)))  # nearest 0.02: the lower loss
        rows = [r for r in history if r["step"] == step]
        new = [r["explored"][WD] for r in rows]
        assert rows[0]["winner"] == winner and new[winner] == pytest.approx(values[winner])  # the winner keeps its
        assert abs(math.log(new[1 - winner] / new[winner])) >= math.log(1.2) - 1e-9  # the mover explores around it
        values = new
    first = [r["explored"][WD] for r in history if r["step"] == 2]
    assert logger.metrics[2]["hdet/group1/weight_decay"] == pytest.approx(0.04)
    assert logger.metrics[3]["hdet/group0/weight_decay"] == pytest.approx(first[0])  # at log_every_n_steps too
    assert world.table.get(1)[:, 0].tolist() == [1.0, 1.0]  # explore={"lr": 1.0}: the LRs never moved
    saved = world.checkpoints[0]["hdet"]["explored"][WD]
    assert saved[:, 0].tolist() == pytest.approx([r["explored"][WD] / 0.01 for r in history if r["step"] == 4])
    resumed_world, resumed, _ = _fit(8, resume=world.checkpoints)
    assert torch.equal(resumed_world.explored.get(1)[WD], world.explored.get(1)[WD])
    assert resumed[0][0].history == history
    # a checkpoint of a run that explored the LR alone, resumed exploring the weight decay too
    lr_only = [{**c, "hdet": {k: v for k, v in c["hdet"].items() if k != "explored"}} for c in world.checkpoints]
    with pytest.warns(UserWarning, match=r"holds no tables of the explored hyperparameters \['weight_decay'\]"):
        fresh_world, _, _ = _fit(4, resume=lr_only)
    assert fresh_world.explored.get(1)[WD][:, 0].tolist() == [0.5, 4.0]  # `explore`'s initial multipliers


# ------------------------------------------------------------------ the records and the replay
def test_the_vote_history_gets_a_column_per_explored_name() -> None:
    rows = [{"step": 2, "group": g, "lr": 0.1, "loss": 1.0, "weight": 0.5, "winner": 0, "rescued": False,
             "reason": "", "explored": {WD: 0.01 * (g + 1)}} for g in range(2)]
    plain = vote_rows(rows)
    assert list(plain[0]) == ["step", "group", "lr", "loss", "weight", "winner", "rescued", WD]
    assert [r[WD] for r in plain] == [0.01, 0.02]


def test_the_replay_follows_each_interval_winners_weight_decay() -> None:
    rows = [{"step": s, "group": g, "lr": 0.1, "winner": w, WD: str(v)}  # as read back from vote_history.csv
            for s, w, values in ((3, 1, (0.02, 0.08)), (6, 0, (0.04, 0.01))) for g, v in enumerate(values)]
    trajectory = LRTrajectory.from_votes(rows, [1.0, 1.0], {WD: [0.5, 2.0]})
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.01)
    ReplayHooks(trajectory).attach(opt)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0][WD]))
    for _ in range(8):
        p.grad = torch.zeros(1)
        opt.step()
    # interval 0: vote 3's winner (group 1) at its initial 2x; then vote 6's winner at vote 3's value; then its own.
    assert seen == pytest.approx([0.02] * 3 + [0.02] * 3 + [0.04] * 2, rel=1e-12)
    assert opt.param_groups[0][WD] == 0.01
    with pytest.raises(ValueError, match=r"initial multipliers for them; pass \{'lr': \[...\], 'weight_decay'"):
        LRTrajectory.from_votes(rows, [1.0, 1.0])


# ------------------------------------------------------------------ the one multi-process run (2 ranks, gloo)
class _DecayedBoring(SGDBoring):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make_scheduler("step", opt), "interval": "step"}}


class _DecayRecorder(Recorder):
    """Also records the weight decay every step used (inside the strategy's step: this group's own)."""

    def __init__(self, out) -> None:
        super().__init__(out)
        self.decays: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.decays.append(float(optimizer.param_groups[0][WD]))

    def on_fit_end(self, trainer, pl_module) -> None:
        super().on_fit_end(trainer, pl_module)
        torch.save(self.decays, self.out / f"decays{trainer.global_rank}.pt")


def test_each_group_trains_with_its_own_weight_decay_the_votes_move_it_and_the_replay_repeats_it(tmp_path) -> None:
    steps = 10  # votes at 4 and 8 (a checkpoint right after it), the final vote at 10
    kwargs = dict(max_steps=steps, limit_val_batches=0)
    # Every rank's data and so the winners follow the global seed, which Lightning's launcher applies in each rank.
    seed_everything(0)
    hdet = quiet_trainer(
        devices=2, strategy=HDETStrategy(lr_multipliers=[0.5, 2.0], explore={WD: [2.0, 0.5]}, start_method=START),
        callbacks=[HDETCallback(every_n_steps=4, search=False), _DecayRecorder(tmp_path / "hdet"),
                   ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=8, save_top_k=-1)],
        logger=CSVLogger(tmp_path, name="search"), enable_checkpointing=True, **kwargs)
    hdet.fit(_DecayedBoring(lr=0.1))
    history = load_ranks(tmp_path / "hdet", 2)[0]["history"]
    decays = [torch.load(tmp_path / "hdet" / f"decays{r}.pt") for r in range(2)]  # rank r is group r
    assert [d[0] for d in decays] == pytest.approx([0.02, 0.005], rel=1e-12)  # 0.01 x its own multiplier
    given = {(r["step"], r["group"]): r["explored"][WD] for r in history}
    for g in range(2):
        assert decays[g][:4] == pytest.approx([decays[g][0]] * 4, rel=1e-12)
        assert decays[g][4:8] == pytest.approx([given[4, g]] * 4, rel=1e-12)  # what the vote at 4 gave it
        assert decays[g][8:] == pytest.approx([given[8, g]] * 2, rel=1e-12)
    assert any(decays[g][4] != decays[g][3] for g in range(2)), "a vote moved a group's weight decay"
    checkpoint = torch.load(tmp_path / "ckpt" / "epoch=0-step=8.ckpt", weights_only=False)
    saved = (checkpoint["hdet"]["explored"][WD][:, 0] * 0.01).tolist()
    assert saved == pytest.approx([given[8, 0], given[8, 1]], rel=1e-12)
    assert "weight_decay" in (tmp_path / "search" / "version_0" / "vote_history.csv").read_text().splitlines()[0]

    winners = {row["step"]: row["winner"] for row in history}
    expected = [decays[winners[next(v for v in sorted(winners) if v > i)]][i] for i in range(steps)]
    seed_everything(0)
    replay = HDETReplay(tmp_path / "search")  # the log dir: vote_history.csv, hparams.yaml's initial multipliers
    plain = quiet_trainer(devices=1, callbacks=[replay, _DecayRecorder(tmp_path / "plain")], **kwargs)
    plain.fit(_DecayedBoring(lr=0.1))
    replayed = torch.load(tmp_path / "plain" / "decays0.pt")
    assert replayed == pytest.approx(expected, rel=1e-12) and len(set(expected)) > 1, (replayed, expected)


def test_a_list_with_another_group_count_is_refused_when_the_trainer_is_built() -> None:
    from lightning.pytorch import Trainer

    with pytest.raises(ValueError, match=r"`explore` must be one multiplier per group \(2\), got \[1.0, 2.0, 3.0\]"):
        Trainer(accelerator="cpu", devices=2, strategy=HDETStrategy(explore={WD: [1.0, 2.0, 3.0]}), logger=False)
