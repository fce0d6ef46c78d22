"""DiLoCo on torchft across processes, as a fault-tolerance system: a Lighthouse (torchft's, in this process) and
one-process Lightning jobs on loopback over gloo (tests/scripts/torchft_job.py). The healthy jobs end at the
DiLoCo model computed here by hand with a NaN job left out of every round; with a job SIGKILLed mid-round and one
that joins late, the others finish together; a job resumes from its checkpoint. Every wait is bounded (past the
deadline every job is killed and the test fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")
from torchft.coordination import LighthouseServer  # noqa: E402

from benchmarks import forked  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "torchft_job.py"
sys.path.insert(0, str(SCRIPT.parent))
from torchft_job import inner_optimizer, job_batches, make_model  # noqa: E402

STEPS, H = 40, 10  # four rounds per job
DEADLINE = 300.0  # seconds for a whole run: start-ups of 10-60 s per job on a loaded 2-core machine


class Run:
    """A Lighthouse and the jobs started against it; :meth:`wait` bounds every job by the deadline."""

    def __init__(self, tmp: Path, min_replicas: int, join_timeout_ms: int = 5000) -> None:
        tmp.mkdir(exist_ok=True)
        self.tmp, self.min_replicas = tmp, min_replicas
        # a dead or frozen job stops heartbeating: after 2 s the next quorum goes on without it; a live one late at a
        # round's start (a loaded machine) is waited for 5 s
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas,
                                           join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=2000)
        self.jobs: dict[int, forked.Forked] = {}
        self.start = time.monotonic()

    def launch(self, job: int, *extra: str) -> None:
        """Start job ``job``, forked from an interpreter that imported torch and Lightning once (benchmarks/forked.py:
        3 or 4 jobs a test spared ~4 s of imports each)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONPATH": str(REPO)}
        self.jobs[job] = forked.start(
            str(SCRIPT), ["--lighthouse", self.lighthouse.address(), "--job", str(job),
                          "--min-replicas", str(self.min_replicas), "--steps", str(STEPS), "--local-steps", str(H),
                          "--out", str(self.out(job)), "--sync", str(self.tmp), "--step-s", "0.05", *extra],
            env, str(self.tmp / f"job{job}.log"))

    def go(self, *jobs: int) -> None:
        """Once each of ``jobs`` has started (Python, Lightning and torch imported), let them ``fit`` together."""
        self.until(lambda: all((self.tmp / f"ready{j}").exists() for j in jobs), f"jobs {jobs} to start")
        for j in jobs:  # how many start together (they meet again once connected); written whole, then renamed
            (self.tmp / f"go{j}.tmp").write_text(str(len(jobs)))
            (self.tmp / f"go{j}.tmp").rename(self.tmp / f"go{j}")

    def rounds(self, job: int) -> int:
        path = self.tmp / f"rounds{job}"
        return int(path.read_text() or 0) if path.exists() else 0

    def until(self, ready, what: str) -> None:  # type: ignore[no-untyped-def]
        while not ready():
            if time.monotonic() - self.start > DEADLINE:
                for p in self.jobs.values():
                    p.kill()
                pytest.fail(f"waited {DEADLINE} s for {what}:\n{self.logs()}")
            time.sleep(0.05)

    def out(self, job: int) -> Path:
        return self.tmp / f"job{job}.json"

    def wait(self) -> dict[int, int]:
        try:
            for p in self.jobs.values():
                p.wait(timeout=max(1.0, DEADLINE - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a job did not end within {DEADLINE} s:\n{self.logs()}")
        finally:
            for p in self.jobs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            self.lighthouse.shutdown()
        return {job: p.returncode for job, p in self.jobs.items()}

    def result(self, job: int) -> tuple[dict, dict[str, torch.Tensor]]:
        return json.loads(self.out(job).read_text()), torch.load(self.out(job).with_suffix(".pt"))

    def logs(self) -> str:
        return "\n".join(f"--- job {j}\n" + (self.tmp / f"job{j}.log").read_text()[-3000:] for j in self.jobs)


def diloco_by_hand(jobs: list[int], rounds: int) -> dict[str, torch.Tensor]:
    """DiLoCo over ``jobs`` in plain PyTorch: each job ``H`` inner steps from the global model on its next
    batches, then the global model steps with Nesterov SGD (0.7, 0.9: outer="published") on the mean of
    ``global - local``."""
    model = make_model()
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    batches = {j: job_batches(j, STEPS) for j in jobs}
    for r in range(rounds):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        deltas = []
        for j in jobs:
            local = make_model()
            local.load_state_dict(start)
            opt = inner_optimizer(local.parameters())
            for x, y in batches[j][r * H:(r + 1) * H]:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(local(x), y).backward()
                opt.step()
            deltas.append({k: start[k] - v for k, v in local.state_dict().items()})
        outer.zero_grad()
        for name, p in model.named_parameters():
            p.grad = sum(d[name] for d in deltas) / len(deltas)
        outer.step()
    return model.state_dict()


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


@pytest.mark.timeout(420)
def test_a_job_killed_mid_round_drops_out_and_one_that_joins_late_heals_and_ends_with_the_others(tmp_path):
    """Three jobs; job 2 is SIGKILLed in the middle of the run's round 2: the jobs left reduce that round without it
    (its heartbeats stopped, so it misses the round's shrink-only quorum). Job 3 starts training once job 0 has committed a round: it heals from a live peer at a
    round's start and ends at the run's last round, with the same model as the others."""
    run = Run(tmp_path, min_replicas=2)
    for job in (0, 1, 3):
        run.launch(job)
    run.launch(2, "--kill-in-round", "2")
    run.go(0, 1, 2)
    run.until(lambda: run.rounds(0) >= 1, "job 0's first round")
    run.go(3)
    codes = run.wait()
    assert codes[2] == -9 and codes[0] == codes[1] == codes[3] == 0, run.logs()
    (r0, s0), (r1, s1), (r3, s3) = run.result(0), run.result(1), run.result(3)
    assert r0["round"] == r1["round"] == r3["round"] == 4, run.logs()
    # job 2 died during the inner steps: the others' quorum before the allreduce left it out, nothing was discarded
    assert r0["discarded"] == r1["discarded"] == 0, run.logs()
    assert r3["healed"] >= 1 and r3["committed"] < 4
    assert_close(s0, s1)
    assert_close(s0, s3)
    assert all(torch.isfinite(v).all() for v in s0.values())


@pytest.mark.timeout(420)
def test_a_live_job_later_than_the_join_timeout_at_a_round_s_end_discards_that_round_heals_and_ends_with_the_others(
        tmp_path):
    """A 1 s join timeout; job 2 sleeps 3 s before round 1's end (a slow node, a checkpoint save): jobs 0 and 1 reduce
    round 1 without it. Job 2's shrink-only quorum can never be met; after its ``timeout`` (5 s) it discards the
    round, heals from a live peer at the next round's start and trains on. Before, it waited out ``quorum_timeout``
    and exited 1 with a TimeoutError. All three end at round 24 with the same model."""
    run = Run(tmp_path, min_replicas=2, join_timeout_ms=1000)
    for job in (0, 1):
        run.launch(job, "--steps", "240")
    run.launch(2, "--steps", "240", "--timeout", "5", "--late-in-round", "1", "--late-s", "3")
    run.go(0, 1, 2)
    assert run.wait() == {0: 0, 1: 0, 2: 0}, run.logs()
    (r0, s0), (r1, s1), (r2, s2) = run.result(0), run.result(1), run.result(2)
    assert r0["round"] == r1["round"] == r2["round"] == 24, run.logs()
    assert r0["discarded"] == r1["discarded"] == 0 and r2["discarded"] >= 1 and r2["healed"] >= 1, run.logs()
    assert_close(s0, s1)
    assert_close(s0, s2)


@pytest.mark.timeout(420)
def test_a_live_job_later_than_the_join_timeout_in_one_of_the_run_s_last_two_rounds_ends_there(tmp_path):
    """A 3 s join timeout; job 2 sleeps 8 s before the end of round ``late`` = 2, the one before the run's last (the
    last round's case is test_torchft_rounds.py's, in one process): jobs 0 and 1 reduce it without job 2, start
    round 3 without it too (their quorum waits 3 s for it) and end.
    Job 2 discards its round after its ``timeout`` (5 s) and ends, exit 0, at the global model of that round's start:
    DiLoCo over the three jobs' first ``late`` rounds, computed here by hand. Before, it asked for another quorum,
    which no job could meet: it waited out ``quorum_timeout`` and exited 1 with a TimeoutError."""
    late = 2
    run = Run(tmp_path, min_replicas=2, join_timeout_ms=3000)
    for job in (0, 1):
        run.launch(job)
    run.launch(2, "--timeout", "5", "--late-in-round", str(late), "--late-s", "8")
    run.go(0, 1, 2)
    assert run.wait() == {0: 0, 1: 0, 2: 0}, run.logs()
    (r0, s0), (r1, s1), (r2, s2) = run.result(0), run.result(1), run.result(2)
    assert r0["round"] == r1["round"] == 4 and r0["discarded"] == r1["discarded"] == 0, run.logs()
    assert (r2["round"], r2["committed"], r2["discarded"], r2["ended_behind"]) == (late, late, 1, True), run.logs()
    assert "it ends now, holding the global model" in (tmp_path / "job2.log").read_text()
    assert_close(s0, s1)
    assert_close(s2, diloco_by_hand([0, 1, 2], late))


@pytest.mark.timeout(420)
def test_with_min_replicas_1_a_job_left_out_while_the_others_end_the_run_ends_there_instead_of_training_apart(
        tmp_path):
    """``min_replicas=1``, a 1 s join timeout; job 2 sleeps 3 s before round 1's end and waits ``timeout`` (10 s) for
    the round's quorum: jobs 0 and 1 reduce round 1 without it and end the run (rounds 2 and 3) meanwhile. Job 2's
    next quorum then holds it alone (once their heartbeats expired), at round 1: nothing to heal from. Before, it
    trained rounds 1-3 alone and ended at round 4, exit 0, with a model apart from the others' (measured: 0.10 off),
    silently. Now it ends there, ``ended_behind``, with DiLoCo's model after round 0, computed here by hand."""
    run = Run(tmp_path, min_replicas=1, join_timeout_ms=1000)
    for job in (0, 1):
        run.launch(job)
    run.launch(2, "--timeout", "10", "--late-in-round", "1", "--late-s", "3")
    run.go(0, 1, 2)
    assert run.wait() == {0: 0, 1: 0, 2: 0}, run.logs()
    (r0, s0), (r1, s1), (r2, s2) = run.result(0), run.result(1), run.result(2)
    assert r0["round"] == r1["round"] == 4 and r0["discarded"] == r1["discarded"] == 0, run.logs()
    assert (r2["round"], r2["committed"], r2["discarded"], r2["healed"], r2["ended_behind"]) == (1, 1, 1, 0, True), \
        run.logs()
    assert "neither healed it nor held the 3 jobs of that round (1 now)" in (tmp_path / "job2.log").read_text()
    assert_close(s0, s1)
    assert_close(s2, diloco_by_hand([0, 1, 2], 1))


def frozen_third_job(tmp_path, timeout: str, freeze: str) -> Run:
    """Jobs 0 and 1 healthy, job 2 frozen (``freeze`` in round 1), each with this allreduce ``timeout``: the run once
    jobs 0 and 1 ended by themselves (job 2 killed then), both exited 0."""
    run = Run(tmp_path, min_replicas=2)
    for job in (0, 1):
        run.launch(job, "--timeout", timeout)
    run.launch(2, "--timeout", timeout, freeze, "1")
    run.go(0, 1, 2)
    try:
        run.until(lambda: run.jobs[0].poll() is not None and run.jobs[1].poll() is not None, "jobs 0 and 1 to end")
    finally:
        run.jobs[2].kill()
    codes = run.wait()
    assert codes[0] == codes[1] == 0, run.logs()
    return run


@pytest.mark.timeout(420)
def test_a_job_frozen_mid_round_is_left_out_after_the_heartbeat_timeout_not_the_allreduce_timeout(tmp_path):
    """Job 2 SIGSTOPs itself (its heartbeats too) in the middle of round 1, with a 300 s allreduce timeout: the others
    take the round's quorum again before its allreduce, the Lighthouse drops job 2 once its heartbeats are 2 s old,
    and they reduce without it. Before, job 2 stayed in the quorum of the round's start and the others waited in the
    allreduce until the timeout (past this test's deadline), then discarded the round."""
    run = frozen_third_job(tmp_path, "300", "--freeze-in-round")
    (r0, s0), (r1, s1) = run.result(0), run.result(1)
    assert r0["round"] == r1["round"] == 4 and r0["discarded"] == r1["discarded"] == 0, run.logs()
    assert_close(s0, s1)


@pytest.mark.timeout(420)
def test_a_job_frozen_at_the_round_s_allreduce_stalls_the_others_timeout_then_that_round_is_discarded(tmp_path):
    """Job 2 SIGSTOPs itself as round 1's allreduce starts, after the round's quorum (so it is in the allreduce's
    group): gloo cannot abort that allreduce (docs/elastic.md says why), so the others wait out ``timeout`` (8 s),
    discard the round, leave job 2 out of the next quorum (its heartbeats stopped) and train round 1 again: they end
    at round 4, one round discarded, with the same model. Nothing hangs: the wait is bounded by ``timeout``."""
    run = frozen_third_job(tmp_path, "8", "--freeze-in-allreduce")
    (r0, s0), (r1, s1) = run.result(0), run.result(1)
    assert (r0["round"], r0["discarded"], r1["round"], r1["discarded"]) == (4, 1, 4, 1), run.logs()
    assert_close(s0, s1)


@pytest.mark.timeout(420)
def test_jobs_end_at_diloco_s_model_with_a_nan_job_left_out_of_every_round(tmp_path):
    """Jobs 0 and 1 are healthy, job 2's loss is NaN from its first step: its pseudo-gradient is rejected in every
    round (never in the mean: with ``max_rejections`` above the run's rounds it stays), it restarts from the global
    model each time, and all three end exactly where DiLoCo over jobs 0 and 1 alone ends, computed here by hand (a
    quorum of three: every round holds all of them; no round is discarded, no job heals)."""
    run = Run(tmp_path, min_replicas=3)
    for job in (0, 1):
        run.launch(job)
    run.launch(2, "--nan-from-step", "0", "--max-rejections", "10")
    run.go(0, 1, 2)
    assert run.wait() == {0: 0, 1: 0, 2: 0}, run.logs()
    expected = diloco_by_hand([0, 1], STEPS // H)
    for job in (0, 1, 2):
        record, state = run.result(job)
        assert record == {"committed": 4, "discarded": 0, "rejected": 4 if job == 2 else 0, "healed": 0, "round": 4,
                          "global_step": STEPS, "ended_behind": False,
                          "ddp": False}  # one rank: no DDP wrapper (nothing to reduce)
        assert_close(state, expected)


@pytest.mark.timeout(420)
def test_jobs_reducing_in_bfloat16_end_together_near_diloco_s_model(tmp_path):
    """``compression="bf16"``: two jobs' pseudo-gradients travel (and are summed) as bfloat16. Both jobs take the same
    outer steps, so they end at the same model, bit for bit; DiLoCo in float32 by hand is within bfloat16's
    rounding of it (8 bits of mantissa: ~0.4 % of each update), not equal (the float32 wire is, to 1e-5)."""
    run = Run(tmp_path, min_replicas=2)
    for job in (0, 1):
        run.launch(job, "--compression", "bf16")
    run.go(0, 1)
    assert run.wait() == {0: 0, 1: 0}, run.logs()
    (r0, s0), (r1, s1) = run.result(0), run.result(1)
    assert r0["committed"] == r1["committed"] == 4
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
    expected = diloco_by_hand([0, 1], STEPS // H)
    gap = max(float((s0[k] - expected[k]).abs().max()) for k in s0)
    assert 1e-5 < gap < 1e-2, gap


@pytest.mark.timeout(420)
def test_a_job_resumed_from_its_checkpoint_at_a_round_s_end_ends_where_it_would_have(tmp_path):
    """A job alone (a quorum of one) runs 40 steps; another, its twin under a second Lighthouse, stops after 20 with a
    checkpoint at that round's end and resumes from it to 40: the same rounds, the same model (the checkpoint held
    the global model, the outer momentum and the round)."""
    whole, first = Run(tmp_path / "whole", min_replicas=1), Run(tmp_path / "first", min_replicas=1)
    checkpoint = tmp_path / "first" / "round.ckpt"
    whole.launch(0)
    first.launch(0, "--steps", "20", "--checkpoint", str(checkpoint))
    whole.go(0)
    first.go(0)
    assert whole.wait() == {0: 0} and first.wait() == {0: 0}, whole.logs() + first.logs()
    assert first.result(0)[0]["round"] == 2 and checkpoint.is_file()
    second = Run(tmp_path / "second", min_replicas=1)
    second.launch(0, "--resume", str(checkpoint))
    second.go(0)
    assert second.wait() == {0: 0}, second.logs()
    (r_whole, s_whole), (r_second, s_second) = whole.result(0), second.result(0)
    assert r_second["round"] == r_whole["round"] == 4 and r_second["committed"] == 2
    assert_close(s_second, s_whole)


@pytest.mark.timeout(420)
def test_jobs_of_two_ranks_train_ddp_inside_and_end_at_diloco_s_model(tmp_path):
    """Two jobs of two ranks each (one torchft replica group each; rank r of a job reduces with rank r of the
    other): both ranks of a job read its stream, so DDP inside changes nothing and the jobs end at DiLoCo's model."""
    run = Run(tmp_path, min_replicas=2)
    for job in (0, 1):
        run.launch(job, "--devices", "2", "--steps", "20")
    run.go(0, 1)
    assert run.wait() == {0: 0, 1: 0}, run.logs()
    expected = diloco_by_hand([0, 1], 2)
    for job in (0, 1):
        record, state = run.result(job)
        assert (record["round"], record["committed"], record["discarded"], record["ddp"]) == (2, 2, 0, True)
        assert_close(state, expected)
