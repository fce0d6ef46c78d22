"""Benchmark 6 (elastic runs: OuterService and torchft, faults injected) at its quick settings, in a file of its own:
the two pytest workers each run whole files, and this one test is the suite's longest."""

import pytest

from tests.bench_quick import run_quick


@pytest.mark.timeout(1500)
def test_elastic_quick_mode(tmp_path):
    # Three workers or jobs per arm (a kill leaves torchft's two), the single job's ranks forked: every arm of the
    # full run at a smaller size.
    data, table, _ = run_quick(tmp_path, "elastic", "--budget", "72", "--step-s", "0.02", "--workers", "3",
                               "--single-start-method", "fork")
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
