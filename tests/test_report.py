"""The report on a small recorded run: loading CSVLogger, TensorBoard and W&B offline runs and a vote history, and
every figure."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from tests.report_synthetic import (
    GROUPS, ROUND_EVERY, STEPS, WORKERS, offline_wandb_env, record_run, synthetic_metrics,
)

from lightning_hdet.records import History, load_history, make_figures
from lightning_hdet.records import figures as figures_module
from lightning_hdet.records import history as history_module
from lightning_hdet.records import report
from lightning_hdet.records.history import votes
from lightning_hdet.records.wandb import log_vote_history

pytest.importorskip("matplotlib")

DOCUMENTED_KEYS = (
    {f"hdet/group{g}/{k}" for g in range(GROUPS) for k in ("lr", "loss")}
    | {f"hdet/vote/weight{g}" for g in range(GROUPS)}
    | {"hdet/vote/winner", "hdet/mean_lr", "hdet/rescues", "async/outer_updates"}
    | {f"async/worker{w}/{k}" for w in range(WORKERS)
       for k in ("steps_per_s", "local_steps", "staleness", "compute_s", "wait_s")}
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One real 1-process run written by a CSVLogger, a TensorBoardLogger and an offline WandbLogger at once."""
    root = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        offline_wandb_env(mp, root)
        csv_logger = CSVLogger(root / "csv", name="", version="")
        tb_logger = TensorBoardLogger(root / "tb", name="", version="")
        wandb_logger = WandbLogger(offline=True, save_dir=str(root), project="report-test")
        record_run([csv_logger, tb_logger, wandb_logger])
        wandb_logger.experiment.finish()  # flush the transaction log before reading it back
    runs = list((root / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    return {"csv": Path(csv_logger.log_dir), "tb": Path(tb_logger.log_dir), "wandb": runs[0]}


@pytest.fixture(scope="module")
def expected():
    table = synthetic_metrics()
    vote_steps = [s for s in range(STEPS) if "hdet/vote/winner" in table[s]]
    return {
        "table": table,
        "vote_steps": vote_steps,
        "winners": [int(table[s]["hdet/vote/winner"]) for s in vote_steps],
        "rounds": len(range(0, STEPS, ROUND_EVERY)),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["csv", "tb", "wandb"])
def test_history_has_every_documented_key_and_value(recorded, expected, kind):
    history = load_history(recorded[kind])
    assert DOCUMENTED_KEYS <= history.keys
    assert sorted(history.rows) == list(range(STEPS))
    for step, row in expected["table"].items():
        for key, value in row.items():
            assert history.rows[step][key] == pytest.approx(value, rel=1e-6), (step, key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["csv", "tb", "wandb"])
def test_cli_writes_every_png(recorded, kind, tmp_path, capsys):
    assert report.main([str(recorded[kind]), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / f"{name}.png") for name in figures_module.FIGURE_NAMES]
    for path in map(Path, printed):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_figures_show_groups_votes_and_workers(recorded, expected):
    history = load_history(recorded["csv"])
    figures = make_figures(history)
    assert list(figures) == list(figures_module.FIGURE_NAMES)

    ax = figures["hdet_loss"].axes[0]
    assert [line.get_label() for line in ax.get_lines()] == [f"group {g}" for g in range(GROUPS)]
    for g, line in enumerate(ax.get_lines()):
        assert list(line.get_xdata()) == expected["vote_steps"]
        assert list(line.get_ydata()) == pytest.approx(
            [expected["table"][s][f"hdet/group{g}/loss"] for s in expected["vote_steps"]], rel=1e-6)
    (vote_lines,) = [c for c in ax.collections if c.get_gid() == "votes"]
    assert [seg[0][0] for seg in vote_lines.get_segments()] == expected["vote_steps"]
    assert [t.get_text() for t in ax.texts] == [f"g{w}" for w in expected["winners"]]
    (rescue_marks,) = [c for c in ax.collections if c.get_gid() == "rescues"]
    rescue_steps = [s for s in expected["vote_steps"] if expected["table"][s]["hdet/rescues"] >
                    expected["table"][s - 1]["hdet/rescues"]]
    assert [x for x, _ in rescue_marks.get_offsets()] == rescue_steps and len(rescue_steps) == 1

    ax = figures["hdet_lr"].axes[0]
    assert ax.get_yscale() == "log"
    group_lines = [line for line in ax.get_lines() if line.get_label().startswith("group")]
    assert len(group_lines) == GROUPS
    assert [line.get_gid() for line in ax.get_lines()].count("mean_lr") == 1
    assert list(group_lines[3].get_ydata()) == pytest.approx(
        [expected["table"][s]["hdet/group3/lr"] for s in range(STEPS)], rel=1e-6)

    ax = figures["hdet_vote_weights"].axes[0]
    weights = ax.images[0].get_array()
    assert weights.shape == (GROUPS, len(expected["vote_steps"]))
    for col, step in enumerate(expected["vote_steps"]):
        assert sum(weights[:, col]) == pytest.approx(1.0, abs=1e-5)
        assert int(weights[:, col].argmax()) == expected["winners"][col]

    ax = figures["async_timeline"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"worker {w}" for w in range(WORKERS)]
    assert len(ax.patches) == 2 * WORKERS * expected["rounds"]  # one compute and one wait bar per round
    ends = {}
    for bar in ax.patches:
        y = round(bar.get_y() + bar.get_height() / 2)
        ends[y] = max(ends.get(y, 0.0), bar.get_x() + bar.get_width())
    for w in range(WORKERS):
        rounds = history_module.worker_rounds(history, w)
        assert ends[w] == pytest.approx(sum(r.compute_s + r.wait_s for r in rounds), rel=1e-6)

    ax = figures["async_staleness"].axes[0]
    assert sum(bar.get_height() for bar in ax.patches) == WORKERS * expected["rounds"]


def test_votes_re_emitted_by_self_log_count_once():
    """LightningModule.log(on_step=True) repeats the last vote at later steps; that is one vote."""
    history = History()
    vote_a = {"hdet/vote/winner": 1, "hdet/vote/weight0": 0.3, "hdet/vote/weight1": 0.7,
              "hdet/group0/loss": 2.0}
    vote_b = {**vote_a, "hdet/group0/loss": 1.5}  # same winner and weights, a new vote
    for step in range(10):
        history.add(step, {"hdet/group0/lr": 1e-3, **(vote_a if step < 5 else vote_b)})
    assert votes(history) == ([0, 5], [1, 1])


def test_history_reads_wandb_spelling_of_non_finite_values():
    history = History()
    history.add(3, {"a": "NaN", "b": "Infinity", "c": True, "d": "text", "e": {"nested": 1}})
    assert math.isnan(history.rows[3]["a"]) and history.rows[3]["b"] == math.inf
    assert history.rows[3]["c"] == 1.0 and set(history.rows[3]) == {"a", "b", "c"}


def test_bad_run_paths_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="run=.*does not exist"):
        load_history(tmp_path / "missing")
    with pytest.raises(ValueError, match="no CSVLogger metrics.csv, TensorBoard event file, W&B"):
        load_history(tmp_path)
    (tmp_path / "metrics.csv").write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="none of the hdet/... or async/... keys"):
        report.write_report(tmp_path)


@pytest.mark.timeout(120)
def test_log_figures_to_wandb_logs_images_only_to_wandb(recorded, tmp_path, monkeypatch):
    offline_wandb_env(monkeypatch, tmp_path)
    figures = make_figures(load_history(recorded["csv"]))
    csv_logger = CSVLogger(tmp_path / "csv")
    wandb_logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="figures")
    assert figures_module.log_figures_to_wandb(csv_logger, figures) == 0
    assert figures_module.log_figures_to_wandb([csv_logger, wandb_logger], figures, step=7) == 1
    wandb_logger.experiment.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    media = (run / "files" / "media" / "images" / "plots").glob("*.png")
    images = sorted(re.sub(r"_\d+_[0-9a-f]+\.png$", "", p.name) for p in media)
    assert images == sorted(figures_module.FIGURE_NAMES)
    history = load_history(run)
    assert {f"plots/{name}.count" for name in figures_module.FIGURE_NAMES} <= history.keys


def test_vote_history_csv_alone_or_beside_the_metrics_gives_the_vote_keys(tmp_path):
    """A run whose metrics lack the vote keys (e.g. another logger got them) still shows its votes from the
    ``vote_history.csv`` beside them, and that file alone is a run too."""
    logger = CSVLogger(tmp_path, name="", version="")
    logger.log_metrics({"train_loss": 1.0}, step=0)
    logger.save()
    rows = [{"step": 4, "group": g, "lr": 0.1 * (g + 1), "loss": 2.0 - g, "weight": float(g), "winner": 1,
             "rescued": g == 0} for g in range(2)]
    log_vote_history(logger, rows + [{**r, "step": 8, "loss": 1.0, "rescued": False} for r in rows])
    for run in (Path(logger.log_dir), Path(logger.log_dir) / "vote_history.csv"):
        history = load_history(run)
        assert votes(history) == ([4, 8], [1, 1])
        assert history.rows[4]["hdet/group1/lr"] == pytest.approx(0.2) and history.rows[4]["hdet/group0/loss"] == 2.0
        assert history_module.rescues(history) == [4]
    assert load_history(Path(logger.log_dir)).rows[0]["train_loss"] == 1.0
