"""Benchmark 6 (elastic runs: OuterService and torchft, faults injected) at its quick settings, in a file of its own:
the two pytest workers each run whole files, and this one test is the suite's longest."""

import pytest

from tests.bench_quick import run_quick


@pytest.mark.timeout(1500)
def test_elastic_quick_mode(tmp_path):
    # Three workers or jobs per arm (a kill leaves torchft's two), every process forked from one interpreter that
    # imported torch and Lightning (23 start-ups of ~4 s of imports each were most of this test's time), the single
    # job's ranks forked: every arm of the full run at a smaller size.
    data, table, _ = run_quick(tmp_path, "elastic", "--budget", "72", "--step-s", "0.02", "--workers", "3",
                               "--launch", "fork", "--single-start-method", "fork")
    rows = data["rows"]
    faults = ("no fault", "one of 3 killed at 50 %", "the 3rd joining at 50 %")
    assert list(rows) == [f"{engine}, {fault}" for engine in ("OuterService async", "torchft DiLoCo")
                          for fault in faults] + ["single job DiLoCo, no fault", "single job async, one of 3 killed at 50 %"]
    for arm, row in list(rows.items())[:7]:
        assert not row["job_lost"], arm
        assert row["final_loss"] < data["rows"]["OuterService async, no fault"]["initial_loss"], arm
    for engine in ("OuterService async", "torchft DiLoCo"):
        assert rows[f"{engine}, one of 3 killed at 50 %"]["exit_codes"][2] == -9  # the last worker or job
    assert rows["OuterService async, no fault"]["steps_done"] == 72
    assert rows["single job async, one of 3 killed at 50 %"]["job_lost"]
    assert rows["torchft DiLoCo, no fault"]["cpu_per_step"] and rows["single job DiLoCo, no fault"]["cpu_per_step"]
    assert len(table) == (2 + 8) + (2 + 2)  # the arms' table, then the CPU per inner step of the two DiLoCo arms


@pytest.mark.parametrize(("argv", "message"), [
    (["--cpu-ab", "2", "--cpu-h", "16"], "200 steps per job must be a multiple of --cpu-h 16"),
    (["--cpu-ab", "2", "--cpu-h", "10", "50", "--budget", "200"], "1 rounds per job at --workers 4 --cpu-h 50"),
    (["--cpu-h", "16", "--budget", "1600"], "--cpu-h sets the CPU A/B only: add --cpu-ab N"),
    (["--cpu-heartbeats", "1"], "--cpu-heartbeats sets the CPU A/B only"),
    (["--cpu-ab", "1", "--cpu-heartbeats", "0.5", "0"], "--cpu-heartbeats 0: heartbeat_s must be > 0"),
    (["--local-steps", "16"], "must be a multiple of --local-steps 16"),
])
def test_elastic_refuses_a_cpu_comparison_that_is_not_whole_rounds_or_not_run(argv, message, capsys):
    from benchmarks.elastic import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_elastic_cpu_comparison_takes_each_h_with_the_budget_in_whole_rounds():
    from benchmarks.elastic import parse_args

    args = parse_args(["--cpu-ab", "6", "--cpu-h", "16", "50", "--budget", "1600"])
    assert (args.cpu_h, args.cpu_heartbeats, args.budget) == ([16, 50], [0.5], 1600)
    assert parse_args(["--cpu-ab", "2", "--local-steps", "10"]).cpu_h == [10]  # the default: --local-steps


def test_t_quantile_matches_student_s_table():
    from benchmarks.elastic import t_quantile

    for df, table in ((1, 12.706), (2, 4.303), (5, 2.571), (9, 2.262), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-3)


def test_cpu_comparison_pairs_repetitions_and_says_whether_the_interval_holds_one():
    from benchmarks.elastic import cpu_ab_rows

    single = [[0.002, 0.004], [0.004], [0.005]]  # means 3, 4 and 5 ms
    run = {"samples": {"single job DiLoCo": single,
                       "torchft, 10 % more": [[0.0033], [0.0044], []],  # the third repetition lost: no pair
                       "torchft, -10 % and +10 %": [[0.0027], [0.0044], [0.005]]}}
    rows = cpu_ab_rows("16", run)
    # Two pairs, both 1.1x: geometric mean 1.1 with no spread; differences 0.3 and 0.4 ms: 0.35 ± 12.706 * 0.0707 / √2
    assert rows[0] == ["16", "torchft, 10 % more", "2", "3.50", "3.85", "1.100", "1.100 [1.100, 1.100]", "no (+10 %)",
                       "+0.350 [-0.285, +0.985]"]
    # 0.9x, 1.1x and 1x: the paired ratios' geometric mean 0.997 holds 1; the medians' ratio (4.4 / 4) does not pair
    assert rows[1][2] == "3" and rows[1][5] == "1.100" and rows[1][6].startswith("0.997 [") and rows[1][7] == "yes"
