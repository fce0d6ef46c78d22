"""HDETReplay: a plain run replays the winning LR trajectory an HDET run found, step by step.

One HDET fit on 2 CPU processes (fork, CSVLogger) with a step schedule; then, in this process, a one-device fit
replays it from the run's log dir. The expected sequence is read from what the HDET run's ranks really applied
(each rank is one group): in each vote interval, the LR of the group that won the vote ending it.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_hdet import HDETCallback, HDETReplay, HDETStrategy, LRTrajectory
from lightning_hdet.hdet.rules.config import HDETConfig
from lightning_hdet.hdet.rules.controller import HDETController, Interval
from lightning_hdet.records.wandb import log_vote_history
from lightning_hdet.replay import ReplayHooks
from tests.helpers import START, Recorder, SGDBoring, load_ranks, quiet_trainer


def _rows(step: int, lrs: list[float], winner: int) -> list[dict]:
    return [{"step": step, "group": g, "lr": lr, "winner": winner} for g, lr in enumerate(lrs)]


def test_trajectory_follows_each_interval_winner() -> None:
    rows = _rows(3, [0.2, 0.8], 1) + _rows(6, [0.4, 0.1], 0) + _rows(8, [0.3, 0.6], 1)
    trajectory = LRTrajectory.from_votes(rows, initial_multipliers=[0.5, 2.0])
    assert [(p.start, p.group, p.multiplier, p.lr) for p in trajectory.pieces] == [
        (0, 1, 2.0, None), (3, 0, None, 0.2), (6, 1, None, 0.1), (8, 1, None, 0.6)]
    # A StepLR schedule (x0.5 every 4 steps) under the hooks: the multiplier is fixed at each piece's first step.
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ReplayHooks(trajectory).attach(opt)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(o.param_groups[0]["lr"]))
    for _ in range(10):
        opt.step()
        sched.step()
    schedule = [1.0] * 4 + [0.5] * 4 + [0.25] * 2
    multipliers = [2.0] * 3 + [0.2 / 1.0] * 3 + [0.1 / 0.5] * 2 + [0.6 / 0.25] * 2  # recorded LR / schedule there
    assert seen == pytest.approx([s * m for s, m in zip(schedule, multipliers)])
    assert opt.param_groups[0]["lr"] == 0.25  # after 10 scheduler steps: the schedule never saw a multiplier


def test_bad_sources_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="initial_multipliers"):
        HDETReplay(_rows(3, [0.2, 0.8], 1))
    with pytest.raises(ValueError, match="one per group"):
        HDETReplay(_rows(3, [0.2, 0.8], 1), initial_multipliers=[1.0])
    with pytest.raises(ValueError, match="exactly one vote_history.csv"):
        HDETReplay(tmp_path)
    with pytest.raises(ValueError, match="no rows"):
        HDETReplay([], initial_multipliers=[1.0])


@pytest.mark.parametrize("layout", ["trainer", "fabric"])
def test_replay_reads_a_checkpoint(tmp_path: Path, layout: str) -> None:
    rows = _rows(3, [0.2, 0.8], 1) + _rows(6, [0.4, 0.1], 0)
    state = {"history": rows, "last_vote_step": 6}
    checkpoint = {"callbacks": {"HDETCallback": state}} if layout == "trainer" else {"hdet": state, "model": {}}
    torch.save(checkpoint, tmp_path / "run.ckpt")
    replay = HDETReplay(tmp_path / "run.ckpt", initial_multipliers=[0.5, 2.0])
    assert [(p.start, p.group) for p in replay.trajectory.pieces] == [(0, 1), (3, 0), (6, 0)]
    with pytest.raises(ValueError, match="initial_multipliers"):
        HDETReplay(tmp_path / "run.ckpt")  # a checkpoint holds no run config
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="no HDETCallback or HDETLoop state"):
        HDETReplay(tmp_path / "plain.ckpt", initial_multipliers=[1.0])


def test_replay_reproduces_the_winning_lrs_of_an_hdet_run(tmp_path: Path) -> None:
    steps = 10  # votes at 4 and 8, the final vote at 10
    kwargs = dict(max_steps=steps, limit_val_batches=0)
    torch.manual_seed(0)
    hdet = quiet_trainer(devices=2, strategy=HDETStrategy(lr_multipliers=[0.5, 2.0], start_method=START),
                         callbacks=[HDETCallback(every_n_steps=4), Recorder(tmp_path / "hdet")],
                         logger=CSVLogger(tmp_path, name="search"), **kwargs)
    hdet.fit(SGDBoring(lr=0.1, scheduler="step"))
    ranks = load_ranks(tmp_path / "hdet", 2)
    history = ranks[0]["history"]
    winners = {row["step"]: row["winner"] for row in history}
    assert sorted(winners) == [4, 8, 10]
    ends = sorted(winners)
    expected = [ranks[winners[next(v for v in ends if v > i)]]["effective_lrs"][i][0] for i in range(steps)]

    torch.manual_seed(0)
    replay = HDETReplay(tmp_path / "search")  # the log dir: vote_history.csv, and hparams.yaml's multipliers
    plain = quiet_trainer(devices=1, callbacks=[replay, Recorder(tmp_path / "plain")], **kwargs)
    plain.fit(SGDBoring(lr=0.1, scheduler="step"))
    replayed = [lrs[0] for lrs in load_ranks(tmp_path / "plain", 1)[0]["effective_lrs"]]
    assert len(replayed) == steps and all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(replayed, expected)), \
        (replayed, expected)
    assert len(set(expected)) > 2, "a trajectory that moves (schedule and votes), not a constant"


def test_the_trained_at_columns_leave_the_replayed_schedule_alone(tmp_path: Path) -> None:
    # The callback's rows since `trained_lr`: the LR (and explored value) before each vote beside the one it set.
    votes = _rows(3, [0.2, 0.8], 1) + _rows(6, [0.4, 0.1], 0)
    plain = [{**r, "explored": {"weight_decay": 0.1 * r["lr"]}} for r in votes]
    rows = [{**r, "loss": 1.0, "weight": 0.5, "rescued": False, "trained_lr": 9.0,
             "trained_explored": {"weight_decay": 7.0}} for r in plain]
    log_vote_history(CSVLogger(tmp_path, name="", version=""), rows)
    assert "trained_lr,weight_decay,trained_weight_decay" in (tmp_path / "vote_history.csv").read_text()
    initial = {"lr": [0.5, 2.0], "weight_decay": [1.0, 3.0]}
    expected = LRTrajectory.from_votes(plain, initial["lr"], initial).pieces
    assert [p.explored["weight_decay"] for p in expected] == pytest.approx([3.0, 0.02, 0.04])
    assert LRTrajectory.from_votes(rows, initial["lr"], initial).pieces == expected
    assert HDETReplay(tmp_path / "vote_history.csv", initial_multipliers=initial).trajectory.pieces == expected


def test_the_controllers_own_rows_replay_as_the_csv_does() -> None:
    # callback.history and a checkpoint hold the controller's rows: with `edge`, `clear`, `reason` and `trained_lr`.
    controller = HDETController(HDETConfig())
    table = torch.tensor([[0.5], [2.0]], dtype=torch.float64)
    for step in (3, 6):
        controller.decide(Interval(step, [2.0, 1.0], [True, True], table, [0.1], False))
    assert {"edge", "clear", "reason", "trained_lr"} <= set(controller.history[0])
    pieces = HDETReplay(controller.history, initial_multipliers=[0.5, 2.0]).trajectory.pieces
    lrs = {(r["step"], r["group"]): r["lr"] for r in controller.history}
    assert [(p.start, p.group, p.multiplier, p.lr, p.explored) for p in pieces] == [
        (0, 1, 2.0, None, {}), (3, 1, None, lrs[3, 1], {}), (6, 1, None, lrs[6, 1], {})]


def test_each_vote_rows_trained_lr_is_what_its_group_applied_at_the_intervals_first_step(tmp_path: Path) -> None:
    # 2 processes, one group each, a step schedule: the CSV's trained_lr against the LRs the ranks really applied.
    torch.manual_seed(0)
    trainer = quiet_trainer(devices=2, strategy=HDETStrategy(lr_multipliers=[0.5, 2.0], start_method=START),
                            callbacks=[HDETCallback(every_n_steps=4), Recorder(tmp_path / "hdet")],
                            logger=CSVLogger(tmp_path, name="run"), max_steps=10, limit_val_batches=0)
    trainer.fit(SGDBoring(lr=0.1, scheduler="step"))
    applied = [rank["effective_lrs"] for rank in load_ranks(tmp_path / "hdet", 2)]  # rank g is group g
    with open(tmp_path / "run" / "version_0" / "vote_history.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    starts = {4: 0, 8: 4, 10: 8}  # each vote's interval begins at the step after the vote before
    assert [(int(r["step"]), int(r["group"])) for r in rows] == [(s, g) for s in starts for g in range(2)]
    for r in rows:
        step, group = int(r["step"]), int(r["group"])
        assert float(r["trained_lr"]) == pytest.approx(applied[group][starts[step]][0], rel=1e-12)
        if step < 10:  # `lr`: what the group applied from the vote on
            assert float(r["lr"]) == pytest.approx(applied[group][step][0], rel=1e-12)
    assert any(float(r["trained_lr"]) != float(r["lr"]) for r in rows), "the votes moved the LRs"
