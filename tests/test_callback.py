"""HDETCallback: voting, blending, safety net, checkpoints and resume (multi-process on CPU with gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_hdet import PBT, Best, HDETCallback, HDETStrategy, SafetyNet, Search, Softmax
from lightning_hdet.experimental import InitNoise, PartialMerge
from lightning_hdet.hdet.lightning.checkpoints import group_file
from tests.helpers import START, LinearModel, Recorder, Regression, SGDBoring, flat_params, load_ranks, trainer_kwargs

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


class Snapshot(Callback):
    """Params at the end of each batch, written per rank (placed before and after the HDETCallback)."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag, self.params = out, tag, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params[trainer.global_step] = flat_params(pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(self.params, self.out / f"{self.tag}{trainer.global_rank}.pt")


def _fit(tmp_path: Path, strategy: Any, callback: HDETCallback, model: Any = None, devices: int = 4,
         extra: tuple = (), ckpt_path: Any = None, **kw: Any) -> list[dict[str, Any]]:
    seed_everything(3)
    cbs = [Snapshot(tmp_path, "pre"), callback, Snapshot(tmp_path, "post"), *extra, Recorder(tmp_path)]
    trainer = Trainer(strategy=strategy, callbacks=cbs, **trainer_kwargs(devices=devices, **kw))
    trainer.fit(model or SGDBoring(), ckpt_path=ckpt_path)
    ranks = load_ranks(tmp_path, devices)
    for r in ranks:
        r["pre"] = torch.load(tmp_path / f"pre{r['rank']}.pt")
        r["post"] = torch.load(tmp_path / f"post{r['rank']}.pt")
    return ranks


def test_a_weighted_partial_merge_through_the_collectives_matches_hand_computation(tmp_path):
    """Every rank lands on ``(1 - s) theta_g + s sum_h w_h theta_h`` through the real all-reduces. The blend rules
    ("mean", "best", full or partial strength), the votes' arithmetic (softmax, PBT, best), rescues, roll-backs and
    the search's end are tested in one process against hand-computed values: tests/test_fake_world.py."""
    strength = 0.5
    cb = HDETCallback(every_n_steps=4, vote=PartialMerge(Softmax(blend="weighted", temperature=5.0), strength=strength),
                      search=False)
    ranks = _fit(tmp_path, HDETStrategy(spread=0.5, gradient_sync="group", start_method=START), cb, max_steps=6,
                 devices=2)
    pre = [r["pre"][4] for r in ranks]
    post = [r["post"][4] for r in ranks]
    vote = [h for h in ranks[0]["history"] if h["step"] == 4]
    weights = [vote[0]["weight"], vote[1]["weight"]]
    assert 0 < weights[0] < 1 and sum(weights) == pytest.approx(1.0)
    target = weights[0] * pre[0] + weights[1] * pre[1]
    for r, p in zip(ranks, pre):
        torch.testing.assert_close(r["post"][4], (1 - strength) * p + strength * target, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(post[0], post[1])
    # every rank holds the merged model at the end of fit
    assert all(torch.equal(r["final_params"], ranks[0]["final_params"]) for r in ranks)
    # identical vote history on every rank
    assert all(r["history"] == ranks[0]["history"] for r in ranks)
    # the fit ran in forked processes: the launching process's callback holds rank 0's result (it stayed None before)
    assert cb.result is not None and cb.result.winners[0] == (4, vote[0]["winner"]) and cb.result.steps == 6


def test_init_noise_gives_each_group_its_own_start(tmp_path):
    """Published warm start: with the same LR and a shared gradient, the groups differ only by their noise."""
    nu = 0.01
    cb = HDETCallback(every_n_steps=1000)
    ranks = _fit(tmp_path, HDETStrategy(spread=0.0, gradient_sync="global", start_method=START), cb, max_steps=2,
                 devices=2, extra=(InitNoise(nu),))
    a, b = ranks[0]["pre"][2], ranks[1]["pre"][2]
    expected = nu * float(a.norm()) * 2 ** 0.5  # E|eps_0 - eps_1|^2 = 2 nu^2 |theta_0|^2
    assert 0.6 * expected < float((a - b).norm()) < 1.4 * expected


def _loss_of(params: torch.Tensor) -> float:
    data = Regression()
    w, b = params[:8].float(), params[8].float()
    return float(torch.nn.functional.mse_loss(data.x @ w[:, None] + b, data.y))


def test_nan_group_is_rescued_and_merged_model_is_finite(tmp_path):
    cb = HDETCallback(every_n_steps=8, vote=Softmax(permute=False), search=False)  # the exploding LR stays on group 1
    strategy = HDETStrategy(num_groups=2, lr_multipliers=[1.0, 1e6], gradient_sync="group", start_method=START)
    ranks = _fit(tmp_path, strategy, cb, model=LinearModel(lr=0.05), max_steps=24)
    assert ranks[0]["rescues"] >= 2
    rescued = [h for h in ranks[0]["history"] if h["rescued"]]
    assert rescued and all(h["group"] == 1 for h in rescued)
    assert ranks[2]["skipped_steps"] > 0 and ranks[3]["skipped_steps"] == ranks[2]["skipped_steps"]
    assert ranks[0]["skipped_steps"] == 0
    final = ranks[0]["final_params"]
    assert bool(torch.isfinite(final).all())
    healthy_loss = _loss_of(ranks[0]["pre"][24])
    assert _loss_of(final) <= healthy_loss * 1.05 + 1e-6
    # a rescued group's multiplier was cut
    assert ranks[0]["lr_multipliers"][1, 0] < 1e6


def _assert_cut_per_rescue(rank: dict, initial: list[float]) -> None:
    """No vote moved LRs (permute=False, diverged groups): each group's LR was halved once per rescue."""
    for g, m in enumerate(initial):
        cuts = sum(1 for h in rank["history"] if h["group"] == g and h["rescued"])
        assert rank["lr_multipliers"][g, 0] == pytest.approx(m * 0.5 ** cuts, rel=1e-9)


def test_global_sync_divergence_rolls_every_group_back(tmp_path):
    """With gradients shared by all ranks, one exploding group poisons the others before it is caught:
    every group rolls back to the last good merge and the exploding group's LR is cut each time."""
    cb = HDETCallback(every_n_steps=4, vote=Softmax(permute=False), search=False)
    strategy = HDETStrategy(lr_multipliers=[1.0, 1e7], gradient_sync="global", start_method=START)
    ranks = _fit(tmp_path, strategy, cb, model=LinearModel(lr=0.05), max_steps=12, devices=2)
    history = ranks[0]["history"]
    assert sorted({h["step"] for h in history}) == [4, 8, 12]
    assert all(h["rescued"] for h in history if h["group"] == 1)
    _assert_cut_per_rescue(ranks[0], [1.0, 1e7])
    final = ranks[0]["final_params"]
    assert bool(torch.isfinite(final).all()) and _loss_of(final) < 100  # not the poisoned model
    assert all(torch.equal(r["final_params"], final) for r in ranks)


@pytest.mark.parametrize(("vote", "search_steps"), [("pbt", None), ("pbt", 6)], ids=["search", "search ends at 6"])
def test_resume_continues_the_ensemble_exactly(tmp_path, vote, search_steps):
    """Resumed at step 8: with ``search_steps=6`` the resumed run must average gradients globally from its first
    step (the strategy wraps the model again before training), or it would not match the straight run. That a
    vote rule's own state (``PBT``'s generator and streaks) resumes exactly is tested in one process (test_fake_world.py)."""

    def run(out: Path, **kw: Any) -> list[dict[str, Any]]:
        ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=4)
        strategy = HDETStrategy(spread=0.5, gradient_sync="group", start_method=START)
        seed_everything(1)  # the same initial weights in every run
        # One batch per epoch, the same on every rank: Lightning's own data order on resume is not under test.
        model = LinearModel(optimizer="adam", lr=0.01, n_train=16)
        search = False if search_steps is None else Search(steps=search_steps)
        callback = HDETCallback(every_n_steps=3, vote=vote, search=search)
        return _fit(out, strategy, callback, model=model, extra=(ckpt,),
                    enable_checkpointing=True, use_distributed_sampler=False, devices=2, **kw)

    straight = run(tmp_path / "a", max_steps=16)
    run(tmp_path / "b", max_steps=8)
    resumed = run(tmp_path / "c", max_steps=16, ckpt_path=str(tmp_path / "b" / "ckpt" / "last.ckpt"))
    for a, c in zip(straight, resumed):
        torch.testing.assert_close(c["pre"][16], a["pre"][16], rtol=0, atol=1e-6)
    for h, k in zip(resumed[0]["history"], straight[0]["history"], strict=True):
        assert (h["step"], h["group"], h["winner"]) == (k["step"], k["group"], k["winner"])
        assert h["lr"] == pytest.approx(k["lr"], rel=1e-9) and h["loss"] == pytest.approx(k["loss"], rel=1e-6)
    if search_steps is not None:
        return  # (what follows does not depend on the search)

    # the checkpoint's state_dict is the merged model and loads in plain Lightning, without this package
    ckpt_file = tmp_path / "b" / "ckpt" / "last.ckpt"
    checkpoint = torch.load(ckpt_file, weights_only=False)
    assert "groups" not in checkpoint["hdet"]  # each group's own state is in its own file beside the checkpoint
    groups = [torch.load(group_file(ckpt_file, g), weights_only=True) for g in range(checkpoint["hdet"]["group_files"])]
    expected = torch.cat([(groups[0]["state_dict"][k] + groups[1]["state_dict"][k]).reshape(-1) / 2
                          for k in ("layer.weight", "layer.bias")])
    code = (
        "import sys, torch; from tests.helpers import LinearModel, flat_params;"
        f"m = LinearModel.load_from_checkpoint({str(ckpt_file)!r});"
        "assert 'lightning_hdet' not in sys.modules;"
        "print(repr(flat_params(m).tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = torch.tensor(eval(out.stdout.strip().splitlines()[-1]), dtype=torch.float64)
    torch.testing.assert_close(loaded, expected.double(), rtol=1e-6, atol=1e-6)


class _StartLR(Callback):
    """Records the optimizer's LR when a (resumed) plain run starts training."""

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def test_a_plain_lightning_resume_continues_at_the_lr_hdet_ended_at(tmp_path):
    """The checkpoint's optimizer LR is the last winner's (multiplier x the optimizer's 0.01): a plain one-process
    Trainer resuming it trains there. The HDET resume of the same file is unchanged (its exact continuation:
    test_resume_continues_the_ensemble_exactly, where the multipliers differ from 1 too)."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=4)
    strategy = HDETStrategy(lr_multipliers=[1.0, 4.0], gradient_sync="group", start_method=START)
    callback = HDETCallback(every_n_steps=4, vote=PBT(resample_probability=0.0), search=False)
    ranks = _fit(tmp_path, strategy, callback, model=LinearModel(optimizer="adam", lr=0.01, n_train=16), extra=(ckpt,),
                 enable_checkpointing=True, use_distributed_sampler=False, devices=2, max_steps=12)
    last = [h for h in ranks[0]["history"] if h["step"] == 12]
    ended = last[last[0]["winner"]]["lr"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == pytest.approx(ended)
    assert saved["hdet"]["plain_lr_multipliers"] == pytest.approx([ended / 0.01])
    start = _StartLR()
    plain = Trainer(callbacks=[start], **trainer_kwargs(devices=1, max_steps=13, enable_checkpointing=False))
    plain.fit(LinearModel(optimizer="adam", lr=0.01, n_train=16), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert start.lr == pytest.approx(ended) and ended != pytest.approx(0.01)


def test_saved_lrs_scale_per_param_group_and_back(tmp_path):
    """By hand: two param groups at 0.1 and 0.02 (a scheduler's base LRs alike) times multipliers 3 and 0.5; the
    inverse restores them. With two optimizers the schedulers are left alone (whose groups they hold is unknown)."""
    from lightning_hdet.hdet.lightning.checkpoints import scale_saved_lrs

    checkpoint = {"optimizer_states": [{"param_groups": [{"lr": 0.1, "initial_lr": 0.1}, {"lr": 0.02}]}],
                  "lr_schedulers": [{"base_lrs": [0.1, 0.02], "_last_lr": [0.05, 0.01]}]}
    scale_saved_lrs(checkpoint, [3.0, 0.5])
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert [groups[0]["lr"], groups[0]["initial_lr"], groups[1]["lr"]] == pytest.approx([0.3, 0.3, 0.01])
    assert checkpoint["lr_schedulers"][0]["base_lrs"] == pytest.approx([0.3, 0.01])
    assert checkpoint["lr_schedulers"][0]["_last_lr"] == pytest.approx([0.15, 0.005])
    scale_saved_lrs(checkpoint, [1 / 3.0, 2.0])
    assert checkpoint["lr_schedulers"][0]["base_lrs"] == pytest.approx([0.1, 0.02]) and groups[1]["lr"] == 0.02
    two = {"optimizer_states": [{"param_groups": [{"lr": 0.1}]}, {"param_groups": [{"lr": 0.2}]}],
           "lr_schedulers": [{"base_lrs": [0.1]}]}
    scale_saved_lrs(two, [2.0])  # one multiplier: every param group takes the first
    assert [s["param_groups"][0]["lr"] for s in two["optimizer_states"]] == pytest.approx([0.2, 0.4])
    assert two["lr_schedulers"][0]["base_lrs"] == [0.1]


def test_a_resume_with_another_group_count_says_where_the_run_ended():
    """By hand: a 4-group checkpoint saved for a plain resume at 0.03 and 0.006 (the winner's row times the schedule's
    0.01 and 0.002); a 2-group run starts afresh and the warning names those LRs. Once HDET has divided them out
    (its own resume), it names none."""
    from lightning_hdet.hdet.lightning.checkpoints import own_group_state, save_plain_lrs

    checkpoint = {"optimizer_states": [{"param_groups": [{"lr": 0.01}, {"lr": 0.002}]}],
                  "hdet": {"group_files": 4, "own": {}}}
    save_plain_lrs(checkpoint, torch.tensor([[1.0, 1.0], [3.0, 3.0], [5.0, 5.0], [9.0, 9.0]]), winner=1)
    with pytest.warns(UserWarning, match=r"holds 4 HDET groups but this run has 2.*ended at lr=\[0.03, 0.006\]"):
        assert own_group_state(checkpoint, num_groups=2, group_index=0) is None
    checkpoint["hdet"]["plain_lr_multipliers"] = None
    with pytest.warns(UserWarning, match=r"schedule's\) LR\.$"):
        own_group_state(checkpoint, num_groups=2, group_index=0)


def test_monitor_votes_on_each_groups_own_validation_metric(tmp_path):
    cb = HDETCallback(every_n_steps=4, monitor="val_loss", search=False)
    ranks = _fit(tmp_path, HDETStrategy(spread=0.5, gradient_sync="global", start_method=START), cb, model=LinearModel(), devices=2,
                 max_steps=8, limit_val_batches=1, val_check_interval=2)
    votes = [h for h in ranks[0]["history"] if h["step"] == 4]
    assert len(votes) == 2 and votes[0]["loss"] != votes[1]["loss"]
    # (a metric that was never logged: tests/test_fake_world.py)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: HDETCallback(every_n_steps=0), "`every_n_steps` must be a positive integer"),
        (lambda: HDETCallback(every_n_steps=2.5), "`every_n_steps` must be a positive integer"),
        (lambda: HDETCallback(vote="median"), "`vote` must be one of"),
        (lambda: HDETCallback(signal="forecast"), "`signal` must be 'mean' or a Signal object"),
        (lambda: HDETCallback(search=2), r"`search` must be True, False or a Search\(...\) object"),
        (lambda: HDETCallback(safety_net="on"), r"`safety_net` must be True, False or a SafetyNet\(...\) object"),
        (lambda: Softmax(temperature=0.0), "`temperature` must be a positive finite number"),
        (lambda: Softmax(temperature=float("nan")), "`temperature` must be a positive finite number"),
        (lambda: Softmax(momentum=1.0), r"`momentum` must be a number in \[0, 1\)"),
        (lambda: Softmax(meta_lr=-1), "`meta_lr` must be a finite number >= 0"),
        (lambda: Softmax(momentum="0.9"), r"`momentum` must be a number in \[0, 1\), got '0.9'"),
        (lambda: HDETCallback(warmup_steps=-1), "`warmup_steps` must be an integer >= 0"),
        (lambda: Best(shrink=0.0), r"`shrink` must be a number in \(0, 1\]"),
        (lambda: Best(min_spread=0.0), "`min_spread` must be a positive finite number"),
        (lambda: Softmax(blend="median"), "`blend` must be one of"),
        (lambda: PartialMerge(Softmax(), strength=0.0), r"`strength` must be a number in \(0, 1\]"),
        (lambda: PartialMerge(Softmax(), strength=1.5), r"`strength` must be a number in \(0, 1\]"),
        (lambda: PBT(quantile=0.75), r"`quantile` must be a number in \(0, 0.5\]"),
        (lambda: HDETCallback(monitor=""), "`monitor` must be None or a logged metric name"),
        (lambda: InitNoise(-0.1), "`std` must be a finite number > 0"),
        (lambda: SafetyNet(divergence_factor=1.0), "`divergence_factor` must be None or a finite number > 1"),
        (lambda: SafetyNet(rescue_lr_factor=1.0), r"`rescue_lr_factor` must be a number in \(0, 1\)"),
        (lambda: SafetyNet(chance_tolerance=0.1), "`chance_tolerance` must be left at its default"),
        (lambda: Search(steps=0), "`search_steps` must be a positive integer or None"),
        (lambda: Search(refine_spread=0.5), "`refine_spread` must be a finite number >= 1"),
        (lambda: Softmax(permute="yes"), "`permute` must be True or False"),
    ],
)
def test_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_callback_needs_hdet_strategy():
    trainer = Trainer(strategy="ddp", accelerator="cpu", devices=1, callbacks=[HDETCallback()], logger=False,
                      max_steps=1, enable_progress_bar=False)
    with pytest.raises(MisconfigurationException, match="needs `Trainer\\(strategy='hdet'\\)`"):
        trainer.fit(SGDBoring())


def test_default_callback_installed_and_user_callback_wins():
    trainer = Trainer(strategy="hdet", accelerator="cpu", devices=2, logger=False)
    model = SGDBoring()
    model.trainer = trainer
    trainer.strategy.connect(model)
    assert sum(isinstance(cb, HDETCallback) for cb in trainer.callbacks) == 1
    (default,) = [cb for cb in trainer.callbacks if isinstance(cb, HDETCallback)]
    assert (default.vote, default.search) == ("pbt", Search())  # the recommended: search, then train
    mine = HDETCallback(every_n_steps=7)
    trainer = Trainer(strategy="hdet", accelerator="cpu", devices=2, logger=False, callbacks=[mine])
    model.trainer = trainer
    trainer.strategy.connect(model)
    assert [cb for cb in trainer.callbacks if isinstance(cb, HDETCallback)] == [mine]


def test_the_published_setup_is_one_name_away():
    """``strategy="hdet_published"``: the paper's fan-out, one shared gradient, the softmax vote on the training loss
    (never a validation metric, even where the data repeat) and no search end; ``"hdet"``: a wide geometric grid
    holding the optimizer's LR (27 ** (-1/4, 0, 1/4, 1/2) with four groups), each group its own DDP job, and
    ``monitor="auto"``."""
    trainer = Trainer(strategy="hdet_published", accelerator="cpu", devices=4, logger=False)
    model = SGDBoring()
    model.trainer = trainer
    trainer.strategy.connect(model)
    (default,) = [cb for cb in trainer.callbacks if isinstance(cb, HDETCallback)]
    assert (default.vote, default.search, trainer.strategy.gradient_sync) == ("softmax", None, "global")
    assert not default._auto and default.settings.monitor is None
    assert trainer.strategy.lr_multipliers[:, 0].tolist() == pytest.approx([8 / 9, 26 / 27, 28 / 27, 10 / 9])
    recommended = Trainer(strategy="hdet", accelerator="cpu", devices=4, logger=False).strategy
    assert recommended.gradient_sync == "group"
    assert recommended.lr_multipliers[:, 0].tolist() == pytest.approx([27 ** (k / 4 - 0.25) for k in range(4)])
    model = SGDBoring()
    model.trainer = recommended_trainer = Trainer(strategy="hdet", accelerator="cpu", devices=4, logger=False)
    recommended_trainer.strategy.connect(model)
    assert [cb._auto for cb in recommended_trainer.callbacks if isinstance(cb, HDETCallback)] == [True]


@pytest.mark.parametrize(("max_steps", "estimated", "expected"),
                         [(40, 99, 10), (42, 99, 10), (-1, 24, 6), (-1, float("inf"), None)])
def test_the_default_search_ends_at_a_quarter_of_the_run(max_steps, estimated, expected):
    """``Search()`` is sized from the run: ``max_steps // 4``, or a quarter of the optimizer steps Lightning
    estimates for a run bounded by epochs; a run of unknown length searches to its end. ``Search(steps=N)`` is taken
    as given."""
    from types import SimpleNamespace

    from lightning_hdet.hdet.lightning.callback import _search_plan, search_steps

    trainer = SimpleNamespace(max_steps=max_steps, estimated_stepping_batches=estimated)
    assert search_steps(Search(), trainer) == expected
    assert search_steps(Search(steps=5), trainer) == 5 and search_steps(None, trainer) is None
    # the settings line names the step search_steps returns (or, bounded by epochs, the fraction)
    plan = f"from step {expected} on" if max_steps > 0 else "25% into the run's estimated steps"
    assert plan in _search_plan(Search(), trainer)
    assert "from step 5 on" in _search_plan(Search(steps=5), trainer)
