import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy

from benchmarks.common import (
    RunSpec,
    best_so_far,
    fit_run,
    markdown_table,
    median,
    update_doc_section,
    write_block,
)
from benchmarks.search_baselines import STARTS, accepted_votes, defaults_options, lr_grid, parse_hdet_arm
from benchmarks.search_pbt import pbt_explore, ray_available
from benchmarks.search_report import to_target
from tests.bench_quick import REPO, run_quick, run_script



def test_lr_grid_is_geometric_around_the_centre():
    lrs = lr_grid(1e-3, 4, 3.0)
    assert len(lrs) == 4
    assert math.prod(lrs) == pytest.approx(1e-3**4)
    assert [b / a for a, b in zip(lrs, lrs[1:])] == pytest.approx([3.0] * 3)


def test_pbt_explore_perturbs_or_resamples_within_range():
    rng = random.Random(0)
    out = [pbt_explore(1e-3, 1e-4, 1e-2, rng) for _ in range(400)]
    perturbed = [x for x in out if x == pytest.approx(1.2e-3) or x == pytest.approx(0.8e-3)]
    resampled = [x for x in out if x not in perturbed]
    assert 0.15 < len(resampled) / len(out) < 0.35
    assert all(1e-4 <= x <= 1e-2 for x in resampled)


def test_best_so_far_and_target():
    curve = best_so_far([(8, 3.0, 2.0), (4, 4.0, 1.0), (12, float("nan"), 3.0), (16, 2.5, 4.0)])
    assert curve == [(4, 4.0, 1.0), (8, 3.0, 2.0), (12, 3.0, 3.0), (16, 2.5, 4.0)]
    assert to_target(curve, 3.0) == (8, 2.0)
    assert to_target(curve, 1.0) == (None, None)


def test_median_treats_missing_as_never():
    assert median([1.0, None, 3.0]) == 3.0
    assert median([None, None, 1.0]) is None
    assert median([2.0, 1.0, 4.0]) == 2.0


def test_update_doc_section_replaces_only_its_block(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# T\n\n<!-- BEGIN a -->\nold a\n<!-- END a -->\n\nprose\n")
    update_doc_section(doc, "a", "new a")
    update_doc_section(doc, "b", markdown_table(["x", "y"], [["1", "2"]]))
    update_doc_section(doc, "b", "new b")
    assert doc.read_text() == (
        "# T\n\n<!-- BEGIN a -->\nnew a\n<!-- END a -->\n\nprose\n\n<!-- BEGIN b -->\nnew b\n<!-- END b -->\n"
    )


def test_a_block_moved_to_the_research_log_is_rewritten_there_with_its_plot_links_fixed(tmp_path):
    docs = tmp_path / "docs"
    (docs / "research").mkdir(parents=True)
    (docs / "benchmarks.md").write_text("# Results\n\nsee `<!-- BEGIN old -->` in prose\n")
    log = docs / "research" / "log.md"
    log.write_text("# Log\n\n<!-- BEGIN old -->\nx\n<!-- END old -->\n")
    assert write_block(docs, "old", "| a |\n\n![old](img/old.png)") == log
    assert log.read_text() == "# Log\n\n<!-- BEGIN old -->\n| a |\n\n![old](../img/old.png)\n<!-- END old -->\n"
    # A block no page holds goes to the results page (markers quoted in prose are not a block), links as written.
    assert write_block(docs, "new", "![new](img/new.png)") == docs / "benchmarks.md"
    assert (docs / "benchmarks.md").read_text().endswith("<!-- BEGIN new -->\n![new](img/new.png)\n<!-- END new -->\n")
    assert "BEGIN old" not in (docs / "benchmarks.md").read_text().split("prose")[1]


TINY_RUN = dict(steps=4, val_every=2, val_batches=2, batch_size=4, block_size=16, max_chars=60_000,
                model={"d_model": 16, "n_layers": 1, "n_heads": 2})


def test_fit_run_resumes_from_checkpoint_at_a_new_lr(tmp_path):
    first = fit_run(RunSpec(lr=1e-3, **TINY_RUN), tmp_path / "a", save_ckpt=tmp_path / "a.ckpt")
    assert [s for s, _, _ in first.val_curve] == [2, 4] and len(first.train_loss) == 4
    resumed = fit_run(RunSpec(lr=5e-3, **{**TINY_RUN, "steps": 8}), tmp_path / "b", ckpt_path=tmp_path / "a.ckpt")
    assert [s for s, _, _ in resumed.val_curve] == [6, 8] and len(resumed.train_loss) == 4
    assert resumed.rank_lrs == [5e-3]
    assert not resumed.diverged and resumed.best_val_loss < first.val_curve[0][1]


@pytest.mark.timeout(180)
def test_fit_run_on_two_processes_records_every_rank(tmp_path):
    # Forked ranks (fit_run's default is ddp_spawn): what is tested is the per-rank record, not the launcher.
    strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
    run = fit_run(RunSpec(lr=1e-3, devices=2, **TINY_RUN), tmp_path, strategy=strategy)
    assert len(run.rank_val_curves) == 2 and run.rank_lrs == [1e-3, 1e-3]
    for curve in run.rank_val_curves:
        assert [s for s, _, _ in curve] == [2, 4] and all(math.isfinite(v) for _, v, _ in curve)
    # Each rank validates on its own shard and reports it unsynchronised.
    assert run.rank_val_curves[0][-1][1] != run.rank_val_curves[1][-1][1]
    assert run.wall_s >= run.fit_s > 0


def test_vote_names_the_callback_does_not_accept_are_skipped_with_the_reason():
    ok, skipped = accepted_votes(["best", "no_such_rule", "softmax", "pbt:heldout@global", "pbt@nowhere", "pbt+search",
                                  "pbt+later", "trust_region", "trust_region@global"])
    assert ok == ["best", "softmax", "pbt+search", "trust_region@global"]
    assert list(skipped) == ["no_such_rule", "pbt:heldout@global", "pbt@nowhere", "pbt+later", "trust_region"]
    assert "no_such_rule" in skipped["no_such_rule"] and "'global' with vote=TrustRegion" in skipped["trust_region"]
    assert "gradient_sync" in skipped["pbt@nowhere"] and "'nowhere'" in skipped["pbt@nowhere"]
    assert "`signal` must be 'mean'" in skipped["pbt:heldout@global"]  # a signal that no longer exists
    assert accepted_votes(["trust_region"], sync="global") == (["trust_region"], {})  # the crash benchmark's set-up
    assert parse_hdet_arm("pbt") == ("pbt", "mean", "group", False)
    assert parse_hdet_arm("softmax:mean@global") == ("softmax", "mean", "global", False)
    assert parse_hdet_arm("pbt@global+search") == ("pbt", "mean", "global", True)
    with pytest.raises(ValueError, match=r"suffixes are \['\+search'\], got '\+later'"):
        parse_hdet_arm("pbt+later")


def test_a_defaults_arm_changes_one_option_of_the_strategy_or_of_the_search():
    from lightning_hdet import Search
    from lightning_hdet.experimental import Halving

    assert defaults_options("defaults") == ({}, Search(), {})
    assert defaults_options("defaults:num_groups=2:refine_spread=1.0") == ({"num_groups": 2}, Search(refine_spread=1.0),
                                                                            {})
    assert defaults_options("defaults:steps=16") == ({}, Search(steps=16), {})  # an integer stays one
    assert defaults_options("defaults:gradient_sync=cluster:vote=halving") == (
        {"gradient_sync": "cluster"}, Search(), {"vote": Halving()})
    assert defaults_options("defaults:lr_multipliers=0.44/1/1/5.2") == ({"lr_multipliers": [0.44, 1.0, 1.0, 5.2]},
                                                                         Search(), {})
    ok, skipped = accepted_votes(["defaults:refine_spread=1.0", "defaults:nope=1", "defaults:refine_spread=0.5"])
    assert ok == ["defaults:refine_spread=1.0"]
    assert "nope" in skipped["defaults:nope=1"] and "`refine_spread` must be" in skipped["defaults:refine_spread=0.5"]


def _search_quick(tmp_path: Path, *extra: str) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    """Run benchmark 2 in quick mode on W = G = 2 (HDET's processes forked) from the good start."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    proc = run_script(tmp_path, "search_baselines", "--quick", "--world-size", "2", "--groups", "2", "--starts", "good",
                      "--start-method", "fork", *extra, "--results-dir", str(results), "--docs-dir", str(docs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((results / "search_baselines_quick.json").read_text())
    text = (docs / "benchmarks.md").read_text()
    assert (docs / "img" / "search_baselines_quick.png").read_bytes()[:4] == b"\x89PNG"
    return data, _block_rows(text, "search_baselines_quick") + _block_rows(text, "search_baselines_quick_detail"), proc


def _block_rows(text: str, name: str) -> list[str]:
    """The table lines of ``name``'s generated block."""
    block = text.split(f"<!-- BEGIN {name} -->\n")[1].split(f"<!-- END {name} -->")[0]
    return [line for line in block.splitlines() if line.startswith("|")]


def _check_equal_compute(data: dict) -> None:
    cfg = data["config"]
    for arm in data["arms"]:
        assert math.isfinite(arm["best_val_loss"]) and arm["best_val_loss"] < math.log(256)
        # Every method spends W x S rank-steps; the grid of whole-job runs G times that.
        scale = cfg["groups"] if arm["method"] == "grid_xG" else 1
        assert arm["curve"][-1][0] == scale * cfg["world_size"] * cfg["steps"]


@pytest.mark.timeout(480)
def test_search_baselines_quick_mode_on_every_workload(tmp_path):
    methods = ["untuned", "grid", "optuna_tpe", "pbt_minimal", "prodigy", "schedulefree"]
    data, table, proc = _search_quick(tmp_path, "--methods", *methods, "--hdet-votes",
                                      "best>pbt@global,softmax+search,no_such_rule", "--full-grid")
    workloads = ("char_lm", "shapes", "tabular")
    cfg = data["config"]
    assert {"meta", "config", "targets_val_loss", "total_wall_s", "rows", "targets", "arms", "skipped"} <= data.keys()
    assert list(data["skipped"]) == ["no_such_rule"]  # reported, not fatal
    ran = [*methods, "hdet_best>pbt@global", "hdet_softmax+search", "grid_xG"]
    assert cfg["run_methods"] == ran
    assert [(r["workload"], r["method"]) for r in data["rows"]] == [(w, m) for w in workloads for m in ran]
    _check_equal_compute(data)
    for arm in data["arms"]:
        if arm["method"] == "grid":
            assert arm["settled_lr"] in arm["lrs_tried"] and len(arm["lrs_tried"]) == cfg["groups"]
        if arm["method"].startswith("hdet_"):  # one run of W processes, G groups starting at the grid's LRs
            assert len(arm["extra"]["history"]) % cfg["groups"] == 0 and arm["extra"]["history"]
            assert arm["settled_lr"] in [row["lr"] for row in arm["extra"]["history"]]
        if ">" in arm["method"]:  # two halves: the second's LRs around the first's, from the first's model
            first, half = arm["extra"]["first_settled_lr"], cfg["steps"] // 2
            second = [row["lr"] for row in arm["extra"]["history"] if row["step"] > half]
            assert second and all(first / 1.5 / 1.2 <= lr <= first * 1.5 * 1.2 for lr in second)
            assert first in arm["lrs_tried"] and arm["curve"][-1][0] == cfg["world_size"] * cfg["steps"]
        if arm["method"].endswith("+search"):  # one fit: from the vote ending the search, a grid of ratio 1.5
            end = min(row["step"] for row in arm["extra"]["history"] if row["step"] >= cfg["steps"] // 2)
            grid = sorted(row["lr"] for row in arm["extra"]["history"] if row["step"] == end)
            assert [b / a for a, b in zip(grid, grid[1:])] == pytest.approx([1.5] * (cfg["groups"] - 1))
        if arm["method"] == "optuna_tpe":
            assert arm["lrs_tried"][0] == pytest.approx(cfg["good_lr"][arm["workload"]] * STARTS[arm["start"]])
        if arm["method"] == "pbt_minimal":  # G members every round, S / T rounds
            assert len(arm["extra"]["history"]) == cfg["groups"] * cfg["steps"] // cfg["pbt_interval"]
        if arm["method"] == "prodigy":  # its own step size: lr (1.0) times its estimate d
            assert arm["lrs_tried"] == [1.0] and arm["settled_lr"] != 1.0
        if arm["method"] == "untuned":  # plain DDP at the starting LR: nothing tried but it
            assert arm["lrs_tried"] == [cfg["good_lr"][arm["workload"]]] == [arm["settled_lr"]]
    # Targets: HDET's median best loss over each baseline's, its LR over the best grid LR.
    targets = {(t["workload"], t["vote"]): t for t in data["targets"]}
    assert set(targets) == {(w, v) for w in workloads for v in ("best>pbt@global", "softmax+search")}
    rows = {(r["workload"], r["method"]): r for r in data["rows"]}
    for (workload, vote), t in targets.items():
        hdet = rows[(workload, f"hdet_{vote}")]["best_val_loss"]
        assert t["vs"]["grid"] == pytest.approx(hdet / rows[(workload, "grid")]["best_val_loss"])
        assert t["vs"]["untuned"] == pytest.approx(hdet / rows[(workload, "untuned")]["best_val_loss"])
        assert t["vs_best_baseline"] == pytest.approx(hdet / min(rows[(workload, m)]["best_val_loss"] for m in methods))
        assert t["vs_grid_xG"] == pytest.approx(hdet / rows[(workload, "grid_xG")]["best_val_loss"])
        assert t["lr_vs_grid"] > 0
    # The results page's block: one row per workload and vote, HDET against the untuned run, the best other
    # method and the full-batch grid; the methods and targets tables go to the detail block (the research log).
    page = _block_rows((tmp_path / "docs" / "benchmarks.md").read_text(), "search_baselines_quick")
    assert page[0].startswith("| workload | start | HDET arm | HDET | untuned |") and len(page) == 2 + 3 * 2
    untuned_cell = f"{targets[('shapes', 'softmax+search')]['vs']['untuned']:.3f}"
    assert any(line.startswith("| shapes | good | softmax+search |") and untuned_cell in line for line in page)
    detail = _block_rows((tmp_path / "docs" / "benchmarks.md").read_text(), "search_baselines_quick_detail")
    issue_59 = detail.index(next(line for line in detail if line.startswith("| workload | optimizer | schedule |")))
    methods_table = [line for line in detail[:issue_59] if line.count("|") == 12]
    assert len(methods_table) == 2 + len(workloads) * len(ran)
    # issue 59's table: one row per workload and HDET arm, on the handed-back models' held-out losses
    handed_back = detail[issue_59 + 2:issue_59 + 2 + len(workloads) * 2]
    cells = [[c.strip() for c in line.split("|")] for line in handed_back]
    assert all(c[9] == "—" and c[7] != "—" for c in cells)  # no lr_find arm ran; untuned did
    # last, HDET ÷ each other baseline on the same losses (no Ray here: PBT's column is absent)
    others = detail[issue_59 + 2 + len(workloads) * 2:]
    assert others[0].startswith("| workload | optimizer | start | HDET arm | HDET loss | ÷ grid (worst) | ÷ TPE (worst) "
                                "| ÷ Prodigy (worst) | ÷ SF (worst) |") and len(others) == 2 + len(workloads) * 2
    assert all("—" not in line for line in others[2:])  # every arm recorded its handed-back model's loss
    assert any("÷ best baseline" in line and "÷ untuned" in line for line in table) and "no_such_rule" in proc.stdout
    # Parts of a run made in parallel merge into the same summary, without training.
    part = tmp_path / "results" / "search_baselines_quick.json"
    merged = tmp_path / "merged"
    merge = run_script(tmp_path, "search_baselines", "--quick", "--world-size", "2", "--groups", "2", "--merge",
                       str(part), "--results-dir", str(merged), "--docs-dir", str(merged),
                       "--name", "extra_seeds")  # its own results file and docs block
    assert merge.returncode == 0, merge.stderr[-3000:]
    again = json.loads((merged / "extra_seeds_quick.json").read_text())
    assert again["rows"] == data["rows"] and again["targets"] == data["targets"]
    assert "<!-- BEGIN extra_seeds_quick -->" in (merged / "benchmarks.md").read_text()


@pytest.fixture(scope="module")
def pbt_and_defaults(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tabular run of Ray Tune's PBT (where Ray is installed) and the ``defaults`` HDET arm for the two tests below
    (starting the script, and Ray, was most of each one's time; PBT's test comes first, under its longer timeout).
    ``--pbt-interval 8``: PBT's two rounds of ``T`` = 8 steps (one exploit between them), which the defaults arm
    must ignore."""
    data, _, _ = _search_quick(tmp_path_factory.mktemp("pbt_and_defaults"), "--workloads", "tabular", "--methods",
                               "untuned", "pbt", "--hdet-votes", "defaults", "--pbt-interval", "8")
    return data


@pytest.mark.timeout(600)
@pytest.mark.skipif(not ray_available(), reason="Ray Tune is in the `bench` extra, not the `test` one")
def test_search_baselines_quick_mode_runs_ray_tune_pbt(pbt_and_defaults):
    data = pbt_and_defaults
    cfg = data["config"]
    [arm] = [a for a in data["arms"] if a["method"] == "pbt"]
    assert cfg["pbt_interval"] == 8 and arm["extra"]["ray_init_s"] > 0
    _check_equal_compute(data)
    history = arm["extra"]["history"]
    # Synchronous rounds: every member reports at every T, G members; losers restart from a donor's checkpoint.
    steps = list(range(cfg["pbt_interval"], cfg["steps"] + 1, cfg["pbt_interval"]))
    assert sorted({row["step"] for row in history}) == steps
    assert len(history) >= cfg["groups"] * len(steps)
    lo, hi = min(arm["lrs_tried"]), max(arm["lrs_tried"])
    assert lo > 0 and math.isfinite(hi) and arm["settled_lr"] in arm["lrs_tried"]


def test_the_defaults_arm_runs_hdet_as_a_user_launches_it(pbt_and_defaults):
    """``--hdet-votes defaults``: ``HDETStrategy()`` and ``HDETCallback()`` with nothing given, whatever ``--groups``
    and ``--pbt-interval`` say: on 2 processes the world size's 2 groups, the first at the start LR itself, a vote
    every 5 steps (16 steps / 4 / 2 = 2, raised to the floor of 5)."""
    data = pbt_and_defaults
    (arm,) = [a for a in data["arms"] if a["method"] == "hdet_defaults"]
    start = data["config"]["good_lr"]["tabular"]
    first = [row for row in arm["extra"]["history"] if row["step"] == 5]
    assert sorted({row["step"] for row in arm["extra"]["history"]}) == [5, 10, 15, 16]  # 16: the final merge
    assert len(first) == 2 and any(math.isclose(lr, start) for lr in arm["lrs_tried"])  # the user's LR trained


@pytest.mark.timeout(360)
def test_hdet_published_quick_mode(tmp_path):
    from benchmarks.hdet_published import PUBLISHED

    data, table, _ = run_quick(tmp_path, "hdet_published", "--arms", "ddp_high", "hdet_full",
                              "--start-method", "fork")
    cfg = data["config"]
    rows = data["rows"]
    assert [r["key"] for r in rows] == ["ddp_high", "hdet_full"]
    assert all(r["lr"] == cfg["high_lr"] for r in rows)
    ddp, hdet = rows
    assert ddp["history"] == [] and ddp["rescues"] == 0
    # HDET votes every T steps (plus the final merge), one history row per member.
    assert len(hdet["history"]) >= cfg["world_size"] * (cfg["steps"] // cfg["every"])
    assert {h["group"] for h in hdet["history"]} == set(range(cfg["world_size"]))
    for r in rows:
        assert r["crashed"] == (not math.isfinite(r["final_val_loss"]) or r["final_val_loss"] >= math.log(256))
        assert [s for s, _, _ in r["val_curve"]] == list(range(cfg["val_every"], cfg["steps"] + 1, cfg["val_every"]))
    assert len(table) == 2 + len(rows) and all(line.count("|") == 11 for line in table)
    assert "published loss" in table[0] and PUBLISHED["HDET full"][1] in table[-1]
    assert (tmp_path / "docs" / "img" / "hdet_published_quick.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(360)
def test_crash_quick_mode_nan_and_collapse(tmp_path):
    from benchmarks.crash import FAILURES

    data, table, proc = run_quick(tmp_path, "crash", "--workloads", "shapes", "--hdet-votes", "best,no_such_rule",
                                  "--start-method", "fork")
    rows = data["rows"]
    assert [(r["failure"], r["arm"]) for r in rows] == [
        (f, a) for f in ("nan", "collapse") for a in ("ddp_low", "ddp_high", "hdet_best")]
    for r in rows:
        optimizer, low, high = FAILURES[("shapes", r["failure"])]
        assert r["optimizer"] == optimizer and r["lr"] == (low if r["arm"] == "ddp_low" else high)
        # Crashed: not finite or no better than a constant predictor over the 6 classes.
        loss = r["final_val_loss"]
        assert r["crashed"] == (not math.isfinite(loss) or loss >= 0.99 * math.log(6))
        assert (r["history"] != []) == (r["arm"] == "hdet_best")
    assert len(table) == 2 + len(rows) and all(line.count("|") == 14 for line in table)
    assert "no_such_rule" in proc.stdout and "÷ DDP low LR" in table[0] and "÷ untuned" in table[0]
    # Parts run in parallel merge into one table, without training.
    merged = tmp_path / "merged"
    merge = run_script(tmp_path, "crash", "--quick", "--seed", "5", "--seeds", "4", "--merge",
                       str(tmp_path / "results" / "crash_quick.json"), "--results-dir", str(merged), "--docs-dir",
                       str(merged))
    assert merge.returncode == 0, merge.stderr[-3000:]
    assert json.loads((merged / "crash_quick.json").read_text())["rows"] == rows
    assert "1 seed(s) from 0," in (merged / "benchmarks.md").read_text()  # the parts' seeds, not the command's


def test_crash_defaults_arm_runs_strategy_hdet_with_one_option_changed(monkeypatch):
    """``--default-votes defaults:evidence=2.5``: ``HDETStrategy()`` and ``HDETCallback()`` with nothing given
    but the seed and that option (the vote interval sized to the run), where ``pbt+search`` gives ``T``; no
    training."""
    from lightning_hdet import Search
    from benchmarks import crash

    args = crash.parse_args(["--default-votes", "pbt+search,defaults,defaults:evidence=2.5,defaults:nope=1"])
    assert args.default_votes == ["pbt+search", "defaults", "defaults:evidence=2.5"]
    assert "defaults:nope=1" in args.skipped
    assert [crash.default_arm_name(v) for v in args.default_votes] == [
        "hdet_pbt+search_defaults", "hdet_defaults", "hdet_defaults:evidence=2.5"]
    seen = {}
    monkeypatch.setattr(crash, "run_config", lambda *a, strategy, callbacks, **k: seen.update(
        strategy=strategy, callbacks=callbacks))
    args.seed = 3
    crash.run_default_arm(args, 0.9, "adamw", "defaults:evidence=2.5", Path("unused"))
    (callback,) = seen["callbacks"]
    assert callback.search == Search(evidence=2.5) and callback.every_n_steps is None
    assert callback.vote == "pbt"
    assert seen["strategy"].gradient_sync == "group" and callback.settings.seed == 3
    crash.run_default_arm(args, 0.9, "adamw", "pbt+search", Path("unused"))
    (callback,) = seen["callbacks"]
    assert callback.every_n_steps == args.every == 30 and callback.search == Search(steps=75)


def test_crash_table_divides_hdet_by_the_untuned_run_and_the_full_batch_grid():
    """Hand-made rows (one seed): HDET 1.2, the untuned run (DDP at the high LR) 1.8, the grid's best 1.0: HDET ÷
    untuned 0.667, ÷ grid ×G 1.2 (≤ 1.5: met); the grid's LRs run from the high LR down to the low one."""
    from benchmarks.crash import grid_lrs, table

    def row(arm: str, loss: float, lr: float) -> dict:
        return {"workload": "tabular", "failure": "collapse", "arm": arm, "seed": 0, "optimizer": "adamw", "lr": lr,
                "final_val_loss": loss, "crashed": False, "nonfinite_steps": 0, "rescues": 0, "final_avg_lr": lr}

    rows = [row("ddp_low", 1.1, 3e-3), row("ddp_high", 1.8, 0.9), row("hdet_pbt", 1.2, 0.9), row("grid_xG", 1.0, 0.03)]
    lines = table(rows).splitlines()
    assert lines[4].split(" | ")[-3:] == ["1.091 ✗", "0.667", "1.200 ✓ |"]
    assert lines[3].split(" | ")[-2:] == ["—", "— |"]  # only HDET arms are divided
    assert grid_lrs(1e-3, 1.0) == pytest.approx([1.0, 0.1, 0.01, 1e-3])


def test_search_plot_draws_the_first_seed_the_arms_ran():
    from benchmarks.search_baselines import Arm, curve_panels

    def arm(method, seed, loss):
        return Arm("shapes", method, "good", seed, 0.01, loss, [(64, loss, 1.0)], [0.01], 0, 1.0)

    arms = [arm("grid", 4, 1.6), arm("grid", 3, 1.5), arm("hdet_pbt", 3, 1.4), arm("hdet_pbt", 5, 1.3)]
    panels = curve_panels(arms, ["shapes"], ["good", "10x high"])
    assert panels == {"shapes, start: good": {"grid": ([64], [1.5]), "hdet_pbt": ([64], [1.4])},
                      "shapes, start: 10x high": {}}


def test_whole_batch_runs_validate_on_the_samples_the_per_process_runs_do():
    """The untuned run, the full-batch grid, Prodigy and schedule-free train on one process with W x the batch:
    they must validate on the same samples as a per-process run (8 batches of 16 = 2 of 64), not on W x more."""
    import torch

    from benchmarks.common import RunSpec, build_workload
    from benchmarks.search_baselines import whole_batch

    base = RunSpec(lr=1e-3, steps=8, batch_size=16, val_batches=8, workload="tabular")
    whole = whole_batch(base, 4)
    assert (whole.devices, whole.batch_size, whole.val_batches) == (1, 64, 2)

    def seen(spec: RunSpec) -> torch.Tensor:
        data = build_workload(spec)[1]
        data.setup("validate")
        return torch.cat([y for (_, y), _ in zip(data.val_dataloader(), range(spec.val_batches))])

    assert torch.equal(seen(base), seen(whole)) and len(seen(whole)) == 8 * 16


def test_search_summary_over_two_seeds_gives_the_targets_as_ratios():
    import argparse

    from benchmarks.search_baselines import Arm
    from benchmarks.search_report import summarise, tables

    def arm(method, seed, loss, lr, steps_to_loss):
        return Arm("shapes", method, "good", seed, lr, loss, [(steps_to_loss, loss, 1.0)], [lr], 0, 1.0)

    arms = [arm("grid", 0, 1.0, 0.01, 64), arm("grid", 1, 1.2, 0.02, 128),
            arm("prodigy", 0, 1.1, 0.003, 64), arm("prodigy", 1, 0.9, 0.003, 64),
            arm("hdet_best", 0, 1.05, 0.005, 64), arm("hdet_best", 1, 1.15, 0.08, 128),
            arm("grid_xG", 0, 1.0, 0.01, 256), arm("grid_xG", 1, 1.0, 0.01, 256)]
    args = argparse.Namespace(workloads=["shapes"], run_methods=["grid", "prodigy", "hdet_best", "grid_xG"],
                              votes=["best"], skipped={}, margin=1.0, quick=False, world_size=4, groups=4, steps=32,
                              pbt_interval=8, val_every=8, val_batches=8, batch_size=16, seeds=2,
                              good_lr={"shapes": 5e-3}, optimizer="schedulefree", schedule="constant")
    summary = summarise(arms, args, {"good": 1.0})
    assert summary["targets_val_loss"]["shapes"] == pytest.approx(2 * 0.9)  # (1 + margin) x best, grid_xG excluded
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["grid"]["best_val_loss"] == pytest.approx(1.1) and rows["grid"]["rank_steps_to_target"] == 96
    assert rows["grid"]["best_val_loss_range"] == "1.000–1.200"
    [t] = summary["targets"]
    # Medians: HDET 1.10, grid 1.10, Prodigy 1.00, grid xG 1.00; per seed HDET / best baseline: 1.05, 1.15 / 0.9.
    assert t["vs"] == {"grid": pytest.approx(1.0), "prodigy": pytest.approx(1.1)}
    assert t["vs_best_baseline"] == pytest.approx(1.1) and t["vs_grid_xG"] == pytest.approx(1.1)
    assert t["vs_best_baseline_per_seed"] == pytest.approx([1.05, 1.15 / 0.9])
    assert t["lr_vs_grid_per_seed"] == pytest.approx([0.5, 4.0]) and t["lr_vs_grid"] == pytest.approx(2.25)
    text = tables(summary, args, {"good": 1.0}, 10.0)
    assert "1.100 ✗" in text and "2.25 ✗" in text and "| 96 |" in text
    assert "LRs searched for schedule-free AdamW" in text


def test_search_summary_leaves_out_a_baseline_that_diverged_in_most_seeds():
    """The grid diverged in both seeds (best loss inf: no finite validation; its median is None): the targets are to
    Prodigy alone (the SGD-with-cosine repeating part stopped on this, comparing None in `min`)."""
    import argparse

    from benchmarks.search_baselines import Arm
    from benchmarks.search_report import summarise

    def arm(method, seed, loss):
        return Arm("shapes", method, "good", seed, 0.01, loss, [], [0.01], 0, 1.0)

    arms = [arm("grid", 0, math.inf), arm("grid", 1, math.inf), arm("prodigy", 0, 1.0), arm("prodigy", 1, 2.0),
            arm("hdet_best", 0, 1.1), arm("hdet_best", 1, 1.6)]
    args = argparse.Namespace(workloads=["shapes"], run_methods=["grid", "prodigy", "hdet_best"], votes=["best"],
                              skipped={}, margin=1.0, quick=False, world_size=4, groups=4, steps=32, pbt_interval=8,
                              val_every=8, val_batches=8, batch_size=16, seeds=2, good_lr={"shapes": 5e-3},
                              optimizer="sgd", schedule="cosine")
    [t] = summarise(arms, args, {"good": 1.0})["targets"]
    assert t["vs"] == {"prodigy": pytest.approx(1.35 / 1.5)} and t["vs_best_baseline"] == pytest.approx(0.9)
    assert t["vs_best_baseline_per_seed"] == pytest.approx([1.1, 0.8])


def test_issue_59_table_divides_the_handed_back_losses_per_seed_and_shows_the_worst():
    from benchmarks.search_baselines import Arm
    from benchmarks.search_report import baselines_table, handed_back_rows, handed_back_table

    def arm(method, start, seed, final, lr=1e-3):
        return Arm("tabular_small", method, start, seed, lr, 9.0, [], [lr], 0, 1.0, final_loss=final)

    arms = [arm("untuned", "good", 0, 1.0), arm("untuned", "good", 1, 2.0), arm("untuned", "good", 2, 1.0),
            arm("hdet_defaults", "good", 0, 1.01), arm("hdet_defaults", "good", 1, 2.4),
            arm("hdet_defaults", "good", 2, 0.9),
            arm("lr_find", "good", 0, 1.1, 4e-3), arm("lr_find", "good", 1, 2.0, 5e-3), arm("lr_find", "good", 2, 1.0),
            arm("untuned", "10x high", 0, 3.0), arm("hdet_defaults", "10x high", 0, 1.04),
            arm("lr_find", "10x high", 0, 1.3, 4e-3)]
    good, high = handed_back_rows(arms, ["defaults"], {"optimizer": "sgd", "schedule": "constant"})
    # good start, per seed HDET / untuned: 1.01, 1.2, 0.9 -> median 1.01, worst 1.2 (over 1.10: the target fails)
    assert good["vs_untuned"] == pytest.approx(1.01) and good["vs_untuned_worst"] == pytest.approx(1.2)
    # ÷ lr_find per seed: 1.01 / 1.1, 2.4 / 2.0, 0.9 / 1.0 -> median 0.918, worst 1.2
    assert good["vs_lr_find"] == pytest.approx(1.01 / 1.1) and good["vs_lr_find_worst"] == pytest.approx(1.2)
    assert good["lr_find_lr"] == pytest.approx(4e-3) and good["seeds"] == 3
    # 10x high on seed 0 only: ÷ grid best is ÷ the good start's untuned run of seed 0
    assert high["vs_grid_best"] == pytest.approx(1.04) and high["vs_untuned"] == pytest.approx(1.04 / 3.0)
    assert high["vs_lr_find"] == pytest.approx(0.8) and high["seeds"] == 1
    text = handed_back_table([good, high], {("tabular_small", "sgd", "constant"): 1e-3})
    assert "| 1.010 (1.200) ✗ |" in text  # the median meets 1.02, the worst seed does not meet 1.10
    assert "| 1.040 (1.040) ✓ |" in text and "| 0.800 (0.800) ✓ |" in text and "| 4 |" in text
    assert baselines_table([good, high]) == ""  # no other baseline ran: no table
    # the other baselines (issue 59's item 4): TPE on every seed of the good start, Ray's PBT on seed 0 only
    arms += [arm("optuna_tpe", "good", 0, 0.5), arm("optuna_tpe", "good", 1, 3.0), arm("optuna_tpe", "good", 2, 1.8),
             arm("pbt", "good", 0, 2.02)]
    good, _ = handed_back_rows(arms, ["defaults"], {"optimizer": "sgd", "schedule": "constant"})
    # ÷ TPE per seed: 1.01 / 0.5, 2.4 / 3.0, 0.9 / 1.8 -> median 0.8, worst 2.02; ÷ PBT one seed: 0.5
    assert good["vs_optuna_tpe"] == pytest.approx(0.8) and good["vs_optuna_tpe_worst"] == pytest.approx(2.02)
    assert good["vs_pbt"] == pytest.approx(0.5) and good["seeds_pbt"] == 1 and good["vs_prodigy"] is None
    text = baselines_table([good])
    assert "| ÷ TPE (worst) | ÷ PBT (Ray) (worst) |" in text and "Prodigy (worst)" not in text
    assert "| 0.800 (2.020) | 0.500 (0.500) | 3 (1) |" in text


def test_the_lr_find_arm_counts_the_finders_steps_in_its_compute(tmp_path):
    from benchmarks.search_lr_find import FINDER_STEPS, run_lr_find

    base = RunSpec(lr=1e-3, steps=40, batch_size=8, val_every=5, val_batches=4, workload="tabular_small",
                   model={"optimizer": "sgd", "width": 16})
    out = run_lr_find(1e-3, base, 4, tmp_path)
    assert out["extra"]["ddp_steps"] == 40 - math.ceil(FINDER_STEPS / 4) == 15
    assert [c for c, _, _ in out["curve"]] == [FINDER_STEPS + 4 * s for s in (5, 10, 15)]  # W x S = 160 in all
    suggested = out["extra"]["suggested_lr"]
    assert out["settled_lr"] == (1e-3 if suggested is None else suggested) and math.isfinite(out["final_loss"])


@pytest.mark.parametrize(("argv", "match"), [
    (["--optimizer", "sgd", "--workloads", "char_lm"], "no good LR measured for \\['char_lm'\\]"),
    (["--schedule", "cosine", "--workloads", "char_lm", "shapes"], "--schedule=cosine applies to the shapes"),
    (["--optimizer", "sgd", "--schedule", "cosine", "--workloads", "shapes"], "give --good-lr WORKLOAD=LR"),
])
def test_search_baselines_refuses_a_start_without_a_measured_good_lr(argv, match, capsys):
    from benchmarks.search_baselines import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--methods", "untuned", "--hdet-votes", "", *argv])
    assert re.search(match, capsys.readouterr().err)


# A stand-in benchmark for the cache's tests: it records that it ran, writes a results file and its docs block
# as the real scripts do, and fails while a file ``fail_<name>`` is next to it (an interrupted run).
FAKE_SCRIPT = r'''
import sys
from pathlib import Path
root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from benchmarks.fake_helper import VALUE
args = sys.argv[1:]
def option(flag, default):
    return Path(args[args.index(flag) + 1]) if flag in args else default
name, results, docs = args[0], option("--results-dir", root / "benchmarks" / "results"), option("--docs-dir", root / "docs")
with open(Path(__file__).with_name("runs.txt"), "a") as runs:
    runs.write(name + "\n")
if Path(__file__).with_name(f"fail_{name}").exists():
    sys.exit(3)
results.mkdir(parents=True, exist_ok=True)
(results / f"{name}.json").write_text(f'{{"value": {VALUE}}}')
page, begin, end = docs / "benchmarks.md", f"<!-- BEGIN {name} -->\n", f"<!-- END {name} -->\n"
text = page.read_text() if page.exists() else ""
block = f"{begin}| {name} | {VALUE} |\n{end}"
page.write_text(text.split(begin)[0] + block + text.split(end)[1] if begin in text else text + block)
'''


def _fake_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    (repo / "lightning_hdet").mkdir()
    (repo / "docs").mkdir()
    (repo / "lightning_hdet" / "core.py").write_text("X = 1\n")
    (repo / "benchmarks" / "__init__.py").write_text("")
    (repo / "benchmarks" / "fake.py").write_text(FAKE_SCRIPT)
    (repo / "benchmarks" / "other.py").write_text(FAKE_SCRIPT.replace("fake_helper", "other_helper"))
    (repo / "benchmarks" / "fake_helper.py").write_text("VALUE = 1\n")
    (repo / "benchmarks" / "other_helper.py").write_text("VALUE = 2\n")
    return repo


def test_run_all_skips_unchanged_parts_and_resumes_after_a_failure(tmp_path, capsys):
    from benchmarks.run_all import Part, main

    repo = _fake_repo(tmp_path)
    parts = [Part("a", "fake.py", ("a",)), Part("b", "other.py", ("b",)), Part("c", "fake.py", ("c",), full=True)]
    runs = repo / "benchmarks" / "runs.txt"

    def run(*argv: str) -> list[str]:
        runs.unlink(missing_ok=True)
        assert main(list(argv), parts, repo) == 0
        return runs.read_text().split() if runs.exists() else []

    assert run() == ["a", "b"]  # `make bench`: the parts not marked full
    record = json.loads((repo / "benchmarks" / "results" / "cache" / "a.json").read_text())
    assert record["wall_s"] > 0 and record["cpu_s"] >= 0  # CPU time beside the wall tells a loaded machine apart
    assert run() == [] and "0 of 2 parts to run" in capsys.readouterr().out
    assert run("--full") == ["c"]  # bench-full adds its parts; the others stay cached
    (repo / "benchmarks" / "other_helper.py").write_text("VALUE = 3\n")  # code only b imports
    assert run("--full") == ["b"]
    (repo / "lightning_hdet" / "core.py").write_text("X = 2\n")  # the package: every part
    assert run("--full") == ["a", "b", "c"]
    assert run("--full", "--parts", "a", "--force") == ["a"]
    # An output edited by hand is regenerated, not vouched for.
    page = repo / "docs" / "benchmarks.md"
    page.write_text(page.read_text().replace("| b | 3 |", "| b | 4 |"))
    assert run() == ["b"] and "docs block 'b' is missing or changed" in capsys.readouterr().out
    (repo / "benchmarks" / "results" / "a.json").unlink()
    assert run() == ["a"]
    # Interrupted: b fails, so it is not recorded; the next run reruns only b.
    (repo / "lightning_hdet" / "core.py").write_text("X = 3\n")
    (repo / "benchmarks" / "fail_b").write_text("")
    runs.unlink()
    assert main([], parts, repo) == 3 and runs.read_text().split() == ["a", "b"]
    (repo / "benchmarks" / "fail_b").unlink()
    assert run() == ["b"]
    # Another command is another key: --quick's records are kept apart from the full-size ones.
    assert run("--quick") == ["a", "b"] and run() == []
    assert sorted(p.name for p in (repo / "benchmarks" / "results" / "cache").iterdir()) == [
        "a.json", "a_quick.json", "b.json", "b_quick.json", "c.json"]


def test_cache_key_follows_the_local_modules_a_script_imports(tmp_path):
    from benchmarks.cache import key_inputs, local_imports

    repo = _fake_repo(tmp_path)
    (repo / "tests").mkdir()
    (repo / "tests" / "helpers.py").write_text("")
    (repo / "benchmarks" / "fake_helper.py").write_text("import os\nfrom tests.helpers import x\nVALUE = 1\n")
    assert [p.relative_to(repo).as_posix() for p in local_imports(repo / "benchmarks" / "fake.py", repo)] == [
        "benchmarks/fake.py", "benchmarks/fake_helper.py", "tests/helpers.py"]
    inputs = key_inputs(["python", "benchmarks/fake.py"], [Path("benchmarks/fake.py")], repo)
    assert list(inputs["code"]) == ["benchmarks/fake.py", "benchmarks/fake_helper.py", "tests/helpers.py"]
    assert set(inputs) == {"hashing", "command", "python", "torch", "lightning", "package", "code"}


# A module as the package or a benchmark holds it: docstrings at every level, comments, literals, operators.
MODULE = '''"""A module."""
import math  # a comment

VALUE = 1


class Scaled:
    """A class."""

    def __init__(self, x):
        """A method."""
        self.x = x * 2  # why two


def scale(x):
    """A function."""
    return math.sqrt(x) + 1.5
'''
DOCS_AND_LAYOUT = {  # edits that change no behaviour: the key stays
    "module-docstring": ('"""A module."""', '"""A module, rewritten\n\nover two paragraphs."""'),
    "method-docstring": ('"""A method."""', "'''A method, reworded.'''"),
    "docstring-removed": ('    """A function."""\n', ""),
    "comment": ("# why two", "# doubled: the reason, rewritten"),
    "comment-and-layout": ("    return math.sqrt(x) + 1.5",
                           "    # a new line\n    return (math.sqrt(x)\n            + 1.5)"),
}
CODE = {  # edits that can change a number: the key changes
    "literal": ("+ 1.5", "+ 1.25"),
    "operator": ("+ 1.5", "- 1.5"),
    "literal-type": ("x * 2", "x * 2.0"),  # equal values, another type
    "name": ("math.sqrt(x)", "math.exp(x)"),
    "statement": ('"""A function."""\n', '"""A function."""\n    x = abs(x)\n'),
}


def _inputs(repo: Path) -> dict:
    from benchmarks.cache import key_inputs

    return key_inputs(["python", "benchmarks/fake.py"], [Path("benchmarks/fake.py")], repo)


@pytest.mark.parametrize("where", ["lightning_hdet/core.py", "benchmarks/fake_helper.py"])
@pytest.mark.parametrize("edit", [*DOCS_AND_LAYOUT, *CODE])
def test_cache_key_changes_with_the_code_not_its_docstrings_comments_or_layout(tmp_path, where, edit):
    from benchmarks.cache import key_of

    repo = _fake_repo(tmp_path)
    path = repo / where
    path.write_text(MODULE)
    before = _inputs(repo)
    old, new = {**DOCS_AND_LAYOUT, **CODE}[edit]
    assert old in MODULE
    path.write_text(MODULE.replace(old, new))
    after = _inputs(repo)
    if edit in DOCS_AND_LAYOUT:
        assert key_of(after) == key_of(before)
    else:
        assert key_of(after) != key_of(before)
        changed = [k for k in before if before[k] != after[k]]
        assert changed == ["package" if where.startswith("lightning_hdet") else "code"]


def test_cache_key_hashes_other_files_as_bytes(tmp_path):
    from benchmarks.cache import key_of

    repo = _fake_repo(tmp_path)
    data = repo / "lightning_hdet" / "corpus.txt"
    data.write_text("a b\n")
    keys = [key_of(_inputs(repo))]
    data.write_text("a b \n")  # whitespace only: a data file's bytes count
    keys.append(key_of(_inputs(repo)))
    data.write_text("# a b\n")  # not parsed: "#" is data, not a comment
    keys.append(key_of(_inputs(repo)))
    assert len(set(keys)) == 3


def test_a_record_hashed_another_way_is_stale_and_says_so(tmp_path):
    from benchmarks.cache import key_of, stale_reason

    repo = _fake_repo(tmp_path)
    inputs = _inputs(repo)
    outputs = {"files": {}, "blocks": {}}
    old = {k: v for k, v in inputs.items() if k != "hashing"}  # a record from before behaviour keys
    assert stale_reason({"key": key_of(old), "inputs": old, "outputs": outputs}, inputs, repo / "docs",
                        repo) == "changed since it ran: hashing"
    assert stale_reason({"key": key_of(inputs), "inputs": inputs, "outputs": outputs}, inputs, repo / "docs",
                        repo) is None


def test_stamp_line_names_commit_command_date_machine_seeds_and_wall_clock(monkeypatch):
    import argparse

    import torch

    from benchmarks import common

    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "crash.py"), "--seeds", "3"])
    line = common.stamp(range(3), wall_s=150.0)
    m = common.STAMP.match(line)
    assert m and not m["legacy"] and m["command"] == "python benchmarks/crash.py --seeds 3"
    assert m["seeds"].strip() == "0–2" and m["wall"] == "2 min" and re.fullmatch(r"[0-9a-f]{10}(\+dirty)?", m["commit"])
    assert f"{os.cpu_count()} cores ({torch.backends.cpu.get_cpu_capability()})" in m["machine"]
    assert "torch " in m["machine"] and "lightning " in m["machine"]
    # the CPU and the kernels torch picked on it: another CPU moves the CNN's numbers with the same code
    assert common.machine()["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and common.machine()["cpu"]
    assert common.seeds_text([4, 1]) == "1, 4" and common.seeds_text(None) == "none"
    assert common.args_seeds(argparse.Namespace(first_seed=3, seed=0, seeds=2)) == [3, 4]
    assert common.args_seeds(argparse.Namespace(seed=5)) == [5] and common.args_seeds(argparse.Namespace()) == []


def test_every_benchmark_computes_with_one_thread_unless_the_caller_says_otherwise():
    """A stamp must not depend on whether its shell exported OMP_NUM_THREADS (the CNN's SGD runs end several per cent
    apart at another thread count); an explicit value is kept. The unset case is the default of torch (one thread per
    core) on a machine with more than one core."""
    probe = "import torch, benchmarks.common as c; print(torch.get_num_threads(), c.machine()['omp_num_threads'])"

    def threads(**env: str) -> str:
        base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        out = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, cwd=REPO, capture_output=True,
                             text=True, check=True)
        return out.stdout.split()

    assert threads() == ["1", "1"]
    assert threads(OMP_NUM_THREADS="2") == ["2", "2"]


def test_a_part_run_by_make_bench_stamps_the_command_the_docs_check_accepts(monkeypatch):
    import shlex

    from benchmarks import common
    from benchmarks.run_all import PARTS, commands

    assert len({p.name for p in PARTS}) == len(PARTS) and all((REPO / "benchmarks" / p.script).is_file() for p in PARTS)
    assert set(commands(full=False)) < set(commands(full=True))
    for part in PARTS:  # run_all starts each script by its absolute path, as below
        monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / part.script), *part.command()[2:]])
        assert common.this_command() == shlex.join(part.command()) in commands(full=True)
        assert (common.this_command() in commands(full=False)) == (not part.full)


@pytest.mark.timeout(360)
def test_hdet_world_quick_mode(tmp_path):
    """Benchmark 7's group table: at W = 2 and 4 the default is one group per rank (the per-rank arm is not run
    twice), every HDET run votes, and the table has one row per workload and W."""
    data, table, _ = run_quick(tmp_path, "hdet_world", "--start-method", "fork")
    rows = data["rows"]
    assert {(r["world"], r["arm"]) for r in rows} == {(w, a) for w in (2, 4) for a in ("ddp", "default")}
    for r in rows:
        assert math.isfinite(r["loss"])
        assert (r["groups"], r["votes"] > 0) == ((r["world"], True) if r["arm"] == "default" else (1, False))
    assert len(table) == 2 + 2 and "2 × 1, 2 votes" in table[2]


@pytest.mark.timeout(360)
def test_hdet_votes_quick_mode(tmp_path):
    """The votes-in-the-search table: each interval puts 1, 2, 4 or 8 votes in the run's first quarter."""
    data, table, _ = run_quick(tmp_path, "hdet_votes", "--start-method", "fork")
    assert sorted({(r["votes_in_search"], r["every"]) for r in data["rows"]}) == [(1, 4), (2, 2), (4, 1), (8, 1)]
    assert len(table) == 2 + 2 and all(math.isfinite(r["loss"]) for r in data["rows"])




def test_search_baselines_starts_prodigy_from_its_own_lr_multiplier():
    """Prodigy's lr multiplies its own estimate: its good value is 1.0 on every workload (AdamW's stay per workload),
    and a --good-lr pair still overrides one."""
    from benchmarks.search_baselines import GOOD_LR, parse_args

    assert parse_args(["--quick"]).good_lr == GOOD_LR
    args = parse_args(["--quick", "--optimizer", "prodigy", "--good-lr", "tabular=0.5"])
    assert args.good_lr == {**{w: 1.0 for w in GOOD_LR}, "tabular": 0.5}


def test_issue_59_table_reads_a_file_of_hdet_arms_against_an_earlier_files_baselines(tmp_path):
    from dataclasses import asdict

    from benchmarks.search_baselines import Arm
    from benchmarks.search_report import main

    def arm(method, start, final):
        return asdict(Arm("tabular_small", method, start, 0, 1e-3, 9.0, [], [1e-3], 0, 1.0, final_loss=final))

    config = {"optimizer": "adamw", "schedule": "constant", "good_lr": {"tabular_small": 1e-3}}
    old = [arm("untuned", "good", 2.0), arm("lr_find", "good", 1.6), arm("hdet_defaults", "good", 2.2)]
    new = [arm("hdet_defaults", "good", 1.8), arm("untuned", "good", 9.0)]  # its untuned: the first file's is kept
    for name, arms in (("before", old), ("after", new)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"config": config, "arms": arms}))
    text = main([str(tmp_path / "before.json"), str(tmp_path / "after.json")])
    assert "| good | defaults [before] | 2.200 | 1.100 (1.100) ✗ |" in text
    assert "| good | defaults [after] | 1.800 | 0.900 (0.900) ✓ | 0.900 (0.900) | 1.125 (1.125) ✗ |" in text


def test_init_nudge_moves_a_seeded_half_of_the_initial_weights_by_one_ulp_and_zero_changes_nothing():
    """--init-nudge K (the resolution measurement): K = 0 is the seed's init bit for bit; K > 0 moves each element
    by at most one ULP upward, about half of them, the same half for the same K (reproducible), another for
    another K."""
    import torch

    from benchmarks.common import build_workload

    def weights(nudge: int, seed: int = 0) -> torch.Tensor:
        torch.manual_seed(seed)
        spec = RunSpec(lr=0.046, steps=8, workload="shapes_small", model={"width": 4}, init_nudge=nudge)
        return torch.cat([p.detach().flatten() for p in build_workload(spec)[0].parameters()])

    def plain(seed: int = 0) -> torch.Tensor:  # the seed's init, built without the harness
        from lightning_hdet.demos import ShapesCNN

        torch.manual_seed(seed)
        return torch.cat([p.detach().flatten() for p in ShapesCNN(lr=0.046, width=4).parameters()])

    seed_init = plain()
    assert torch.equal(weights(0), seed_init)
    one, two = weights(1), weights(2)
    assert torch.equal(one, weights(1))
    moved = one != seed_init
    assert torch.equal(one[moved], torch.nextafter(seed_init, torch.full_like(seed_init, math.inf))[moved])
    assert 0.4 < moved.float().mean() < 0.6
    assert not torch.equal(moved, two != seed_init)
    # the nudge leaves the global RNG as the seed left it: what is drawn after the build is the same
    weights(1)
    after_nudged = torch.rand(4)
    weights(0)
    assert torch.equal(after_nudged, torch.rand(4))


def test_init_nudge_reaches_every_arm_and_refuses_a_negative_value(capsys):
    from benchmarks.search_baselines import base_spec, parse_args, whole_batch

    args = parse_args(["--methods", "untuned", "--hdet-votes", "defaults", "--workloads", "shapes_small",
                       "--optimizer", "sgd", "--init-nudge", "2"])
    base = base_spec(args, "shapes_small", 0.046, seed=1)
    assert base.init_nudge == 2 and whole_batch(base, 4).init_nudge == 2
    assert parse_args(["--methods", "untuned", "--hdet-votes", ""]).init_nudge == 0
    with pytest.raises(SystemExit):
        parse_args(["--methods", "untuned", "--hdet-votes", "", "--init-nudge", "-1"])
    assert "--init-nudge=-1 must be >= 0" in capsys.readouterr().err


def test_evaluate_skips_the_batches_validation_read_when_asked():
    """``skip`` scores the ``batches`` after the first ones. Batch b's labels are all b, the logits -k for class k, so
    a batch's loss is logsumexp + b: batches 0-1 average LSE + 0.5, batches 2-3 LSE + 2.5 (by hand)."""
    import torch
    from lightning.pytorch import LightningDataModule, LightningModule
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import evaluate

    class Data(LightningDataModule):
        def val_dataloader(self):
            return DataLoader(TensorDataset(torch.zeros(8, 1), torch.arange(8) // 2), batch_size=2)

    class Fixed(LightningModule):
        def forward(self, x):
            return -torch.arange(4.0).expand(len(x), 4)

    lse = float(torch.logsumexp(-torch.arange(4.0), 0))
    assert evaluate(Fixed(), Data(), 2) == pytest.approx(lse + 0.5)
    assert evaluate(Fixed(), Data(), 2, skip=2) == pytest.approx(lse + 2.5)
