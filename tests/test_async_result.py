"""The end-of-run result of an async or DiLoCo run, against hand-computed values (one process, no groups)."""

from lightning_hdet.asynchronous.result import make_async_result

STATS = {  # worker 0 has extra keys of WorkerStats, which the result leaves out
    0: {"steps": 30, "rounds": 3, "rejected": 0, "rejected_steps": 0, "push_bytes": 3 * 4096, "pull_bytes": 0,
        "total_compute_s": 1.5, "total_wait_s": 0.25, "compute_s": 0.5, "steps_per_s": 20.0, "staleness": 1},
    2: {"steps": 8, "rounds": 1, "rejected": 2, "rejected_steps": 16, "push_bytes": 3 * 1024 * 1024,
        "pull_bytes": 1024 * 1024, "total_compute_s": 6.0, "total_wait_s": 0.0, "steps_per_s": 4.0},
}


def test_the_result_adds_up_the_workers_and_says_what_each_did() -> None:
    result = make_async_result("sync", 40, 38, 4, STATS, {2: "excluded: 3 pushes in a row rejected", 5: "expired"})
    assert result.rejected == 2 and result.push_bytes == 3 * 4096 + 3 * 1024 * 1024
    assert result.pull_bytes == 1024 * 1024
    assert result.summary().splitlines() == [
        "DiLoCo result: 38 inner steps of a budget of 40 over 2 worker(s)",
        "  4 outer updates, 2 push(es) rejected, 4.0 MiB on the wire (3.0 MiB out, 1.0 MiB in)",
        "  worker 0: 30 steps in 3 rounds, 12.0 KiB out, 0 B in, 1.50 s computing, 0.25 s waiting",
        "  worker 2: 8 steps in 1 round, 2 rejected (16 steps discarded), 3.0 MiB out, 1.0 MiB in, 6.00 s computing,"
        " 0.00 s waiting; excluded: 3 pushes in a row rejected",
        "  worker 5: nothing pushed; expired",
    ]


def test_the_in_process_workers_exchanges_cross_no_wire() -> None:
    """Rank 0's own worker pushes and pulls in the outer optimizer's process: the bytes over the wire are the
    other workers' pushes and pulls, both ways."""
    result = make_async_result("async", 40, 38, 4, STATS, local_worker=0)
    assert result.push_bytes == 3 * 1024 * 1024 and result.pull_bytes == 1024 * 1024
    lines = result.summary().splitlines()
    assert lines[1] == "  4 outer updates, 2 push(es) rejected, 4.0 MiB on the wire (3.0 MiB out, 1.0 MiB in)"
    assert lines[2] == "  worker 0: 30 steps in 3 rounds, in-process, 1.50 s computing, 0.25 s waiting"


def test_the_result_exports_plain_values() -> None:
    out = make_async_result("async", None, 38, 4, STATS).to_dict()
    assert out["mode"] == "async" and out["budget"] is None and out["ended"] == {}
    assert sorted(out["workers"]) == ["0", "2"]
    assert out["workers"]["2"] == {"steps": 8, "rounds": 1, "rejected": 2, "rejected_steps": 16,
                                   "push_bytes": 3 * 1024 * 1024, "pull_bytes": 1024 * 1024, "total_compute_s": 6.0,
                                   "total_wait_s": 0.0, "steps_per_s": 4.0}
    assert make_async_result("async", None, 0, 0, {}).summary() == (
        "Async Local-SGD result: 0 inner steps over 0 worker(s)\n  0 outer updates, 0 push(es) rejected, 0 B on the"
        " wire (0 B out, 0 B in)")


def test_one_round_and_one_outer_update_are_spelled_in_the_singular() -> None:
    one = {1: {**STATS[2], "rounds": 1, "rejected": 0}}
    lines = make_async_result("sync", 8, 8, 1, one).summary().splitlines()
    assert lines[1].startswith("  1 outer update, 0 push(es) rejected")
    assert lines[2].startswith("  worker 1: 8 steps in 1 round, ")
