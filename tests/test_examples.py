"""Every example runs in its small mode (2 CPU processes, few steps) and prints or writes what it promises."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import forked

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, cwd: Path, timeout: float = 240, stderr: bool = False) -> str:
    """The stdout of ``python script *args`` run in ``cwd`` (and its stderr after it, with ``stderr``: warnings,
    Lightning's lines). Forked from an interpreter that imported torch and Lightning once (benchmarks/forked.py: the
    example runs as its own process, as ``__main__``; the ranks it launches are fresh interpreters): ~4 s of CPU
    less per example on the suite's 2 cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    result = forked.run(script, list(args), env, str(cwd), timeout=timeout)
    assert result.returncode == 0, f"{[script, *args]} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout + (result.stderr if stderr else "")


@pytest.mark.timeout(300)
def test_quickstart_prints_votes_and_writes_plots(tmp_path: Path) -> None:
    out = run_example(str(EXAMPLES / "quickstart.py"), "--steps", "10", "--every", "5", "--devices", "2",
                      "--max-chars", "100000", "--multipliers", "0.3", "3", "--out", str(tmp_path),
                      cwd=tmp_path, stderr=True)
    row = r"^\s+(\d+)\s+(\d)\s+([\d.e+-]+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.]+)\s+(\d)\s+(True|False)$"
    rows = re.findall(row, out, re.M)
    assert [(int(s), int(g)) for s, g, *_ in rows] == [(5, 0), (5, 1), (10, 0), (10, 1)], out
    for step in (5, 10):
        weights = [float(r[5]) for r in rows if int(r[0]) == step]
        assert math.isclose(sum(weights), 1.0, abs_tol=2e-3)
    # the first vote's losses were reached at the starting LRs (3e-3 x 0.3 and x 3), whatever the vote then set
    assert [float(r[2]) for r in rows[:2]] == pytest.approx([9e-4, 9e-3], rel=1e-2), out
    assert "last winner: group" in out
    plots = sorted(p.name for p in tmp_path.rglob("*.png"))
    assert plots == ["hdet_loss.png", "hdet_lr.png", "hdet_vote_weights.png"]
    assert "Next: add HDET to your own script (docs/quickstart.md)" in out
    # what a newcomer reads: the process groups said once (not again at the final validate), and every rank
    # validates the same batches (no DistributedSampler at validate, which Lightning warns about)
    assert out.count("HDET: creating 2 process groups") == 1 and "DistributedSampler" not in out, out


def test_quickstart_says_why_it_wrote_no_plots_without_matplotlib(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install -e .` has no matplotlib (the `plots` extra): the demo ends with the fix instead of a traceback."""
    spec = importlib.util.spec_from_file_location("example_quickstart", EXAMPLES / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"step": 5, "group": g, "lr": 0.1 * (g + 1), "loss": 1.0 - g / 10, "weight": float(g), "winner": 1,
             "rescued": False} for g in range(2)]
    with (tmp_path / "vote_history.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "metrics.csv").write_text("step,hdet/group0/lr,hdet/group1/lr\n5,0.1,0.2\n")  # a CSVLogger's
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert module.plots(str(tmp_path)) == (
        "\nPlots: none written (lightning_hdet report plots need matplotlib: pip install 'lightning-hdet[plots]').")


@pytest.mark.timeout(300)
def test_char_lm_hdet_and_ddp(tmp_path: Path) -> None:
    common = ["--steps", "10", "--every", "5", "--max-chars", "100000", "--out", str(tmp_path)]
    out = run_example(str(EXAMPLES / "char_lm.py"), "--strategy", "hdet", "--devices", "2", *common,
                      cwd=tmp_path)
    hdet = json.loads((tmp_path / "hdet" / "summary.json").read_text())
    assert hdet["strategy"] == "hdet" and hdet["steps"] == 10 and hdet["votes"] == 2
    assert len(hdet["final_lrs"]) == 2 and all(lr > 0 for lr in hdet["final_lrs"])
    assert hdet["val_loss"] < math.log(256)  # learned something beyond a uniform guess over bytes
    assert f"final model val_loss {hdet['val_loss']:.4f}" in out
    run_example(str(EXAMPLES / "char_lm.py"), "--strategy", "ddp", "--devices", "1", *common, cwd=tmp_path)
    ddp = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp["strategy"] == "ddp" and ddp["steps"] == 10 and "final_lrs" not in ddp
    assert ddp["val_loss"] < math.log(256)


@pytest.mark.timeout(300)
def test_async_heterogeneous_spends_the_budget(tmp_path: Path) -> None:
    out = run_example(str(EXAMPLES / "async_heterogeneous.py"), "--devices", "2", "--max-steps", "20",
                      "--local-steps", "5", cwd=tmp_path)
    assert "mode=async" in out
    workers = re.findall(r"^\s+(\d)\s+[\d.]+s\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", out, re.M)
    assert [int(w[0]) for w in workers] == [0, 1], out
    assert sum(int(w[1]) for w in workers) == 2 * 20  # the sample budget, shared by speed
    assert all(int(w[2]) >= 1 for w in workers)


@pytest.mark.timeout(300)
def test_cli_fit_with_yaml_runs_votes(tmp_path: Path) -> None:
    run_example(str(EXAMPLES / "cli.py"), "fit", "--config", str(EXAMPLES / "configs" / "hdet.yaml"),
                "--trainer.max_steps=10", "--trainer.val_check_interval=5",
                "--trainer.callbacks.every_n_steps=5",
                "--data.max_chars=100000", f"--trainer.default_root_dir={tmp_path}", cwd=tmp_path)
    (votes,) = tmp_path.rglob("vote_history.csv")
    rows = list(csv.DictReader(votes.open()))
    assert [(int(r["step"]), int(r["group"])) for r in rows] == [(5, 0), (5, 1), (10, 0), (10, 1)]
    (saved,) = tmp_path.rglob("config.yaml")
    config = yaml.safe_load(saved.read_text())
    assert config["trainer"]["strategy"]["class_path"] == "lightning_hdet.HDETStrategy"


def load_cli_example():
    spec = importlib.util.spec_from_file_location("example_cli", EXAMPLES / "cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_cli_print_config_shows_strategy_and_callback_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:  # --print_config prints and exits, as on the command line
        load_cli_example().main([
            "fit", "--config", str(EXAMPLES / "configs" / "hdet.yaml"), "--trainer.devices=4",
            "--trainer.strategy.num_groups=4", "--trainer.strategy.lr_multipliers=[1, 0.5, 0.1, 5]",
            "--trainer.callbacks.vote=softmax", "--print_config",
        ])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hdet.HDETStrategy"
    assert strategy["init_args"]["num_groups"] == 4
    assert strategy["init_args"]["lr_multipliers"] == [1.0, 0.5, 0.1, 5.0]
    assert strategy["init_args"]["gradient_sync"] is None  # the preset's: "group" (test_strategy checks the value)
    callbacks = config["trainer"]["callbacks"]
    (callback,) = [c for c in callbacks if c["class_path"] == "lightning_hdet.HDETCallback"]
    assert callback["init_args"]["vote"] == "softmax" and callback["init_args"]["every_n_steps"] == 20


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_64gpu_recipe_builds_four_groups_at_the_users_learning_rates() -> None:
    # Built (not run) on CPU: 8 nodes x 8 devices is validated when the Trainer is created.
    recipe = ["--config", str(EXAMPLES / "configs" / "recipe_64gpu.yaml"), "--trainer.accelerator=cpu",
              "--trainer.precision=32-true", "--trainer.logger=false"]
    cli = load_cli_example().main(recipe, run=False)
    strategy = cli.trainer.strategy
    assert (strategy.world_size, strategy.num_groups, strategy.layout.group_size) == (64, 4, 16)
    lrs = [cli.model.hparams.lr * m for m in strategy.lr_multipliers[:, 0].tolist()]
    assert lrs == pytest.approx([0.001, 0.0005, 0.0001, 0.005])
    (callback,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "HDETCallback"]
    assert (callback.every_n_steps, callback.vote, callback.search.refine_spread) == (1000, "pbt", 1.5)
    assert callback.settings.safety_net.divergence_factor == 10.0 and callback.settings.vote.quantile == 0.25
    # The command-line overrides shown in docs/recipes.md reach the strategy and the callback.
    overrides = ["--trainer.strategy.lr_multipliers=[1, 0.3, 0.1, 3]",
                 "--trainer.callbacks.every_n_steps=500"]
    cli = load_cli_example().main(recipe + overrides, run=False)
    (callback,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "HDETCallback"]
    assert cli.trainer.strategy.lr_multipliers[:, 0].tolist() == [1.0, 0.3, 0.1, 3.0]
    assert callback.every_n_steps == 500
    # The SLURM script asks for exactly the recipe's processes and launches it.
    script = (EXAMPLES / "slurm_hdet.sh").read_text()
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    assert (int(sbatch["nodes"]), int(sbatch["ntasks-per-node"])) == (8, 8)
    assert "examples/configs/recipe_64gpu.yaml" in script
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm_hdet.sh")], check=True)


@pytest.mark.timeout(300)
def test_the_docs_search_then_train_recipe_ends_the_search_in_one_fit(tmp_path: Path) -> None:
    """docs/hdet.md's recipe under the default launcher: half the steps each group reduces its own gradients, then
    the vote at ``search_steps`` puts the LRs on a grid of ratio 1.5 around the winner's and DDP reduces over both
    ranks."""
    out = tmp_path / "recipe.json"
    run_example(str(ROOT / "tests" / "scripts" / "search_then_train.py"), str(out), cwd=tmp_path)
    got = json.loads(out.read_text())
    assert got["steps"] == 16 and got["syncs"] == [["group", 1]] * 8 + [["global", 2]] * 8
    rows = {(row["step"], row["group"]): row for row in got["history"]}
    winner = rows[(8, 0)]["winner"]
    centre = rows[(4, winner)]["lr"]  # the LR the winner trained at before the vote that ended the search
    assert [rows[(8, g)]["lr"] for g in (0, 1)] == pytest.approx([centre / 1.5**0.5, centre * 1.5**0.5])


@pytest.mark.timeout(480)
def test_torchft_diloco_three_jobs_one_killed(tmp_path: Path) -> None:
    """The Lighthouse and three jobs: job 2 dies mid-round halfway; the two left reduce that round without it and
    end at the run's last round with the same model."""
    pytest.importorskip("torchft")
    out = run_example(str(EXAMPLES / "torchft_diloco.py"), "--steps", "20", "--kill-one", cwd=tmp_path, timeout=420)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["job"], r["round"]) for r in rows] == [(0, 2), (1, 2)], out  # the two left end the run together
    assert rows[0]["held_out_loss"] == rows[1]["held_out_loss"], out
    assert "job 2: ended with -9" in out, out  # killed as planned, in round 1's inner steps
    # the three jobs heartbeat before any asks for a quorum (the strategy connects in its setup, the example's jobs
    # meet after it), so all three are in every round until the kill; job 2, killed during its inner steps, misses
    # round 1's shrink-only quorum: nothing is discarded, no one heals. (Before, a job slow to start could miss the
    # first rounds: it healed into a later one, and a kill in a round of two then left one job, discarded.)
    assert [(r["discarded"], r["healed"], r["committed"], r["ended_behind"]) for r in rows] == [(0, 0, 2, False)] * 2, out
