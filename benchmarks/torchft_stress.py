"""DiLoCo on torchft under injected faults, many runs (``make stress-torchft``; not in ``make test``): counts hangs.

Each run: a Lighthouse (``min_replicas=2``) and ``--jobs`` one-process jobs on loopback (tests/scripts/torchft_job.py,
steps paced by ``--step-s``); the last job gets one fault, in turn: SIGKILLed mid-round, frozen (SIGSTOP, then
killed once the others ended), or NaN from its first step (rejected until it leaves). A run passes when the others
end with exit 0 at the run's last round with the same model; it *hangs* when any survivor is still running at
``--deadline`` seconds (then everything is killed). Reported per fault: runs, passes, hangs, the longest run, and the
survivors' held-out loss over the fault-free run's (target: <= 1.01).

Run: ``python benchmarks/torchft_stress.py [--runs 21]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "torchft_job.py"
sys.path.insert(0, str(SCRIPT.parent))
from torchft_job import job_batches, make_model  # noqa: E402

FAULTS = ("kill", "freeze", "nan")
os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process: its quorum log at INFO drowns the counts


def held_out_loss(state: dict[str, torch.Tensor]) -> float:
    model = make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(x), y)) for x, y in job_batches(999, 16)) / 16


def one_run(args: argparse.Namespace, work: Path, fault: str | None) -> dict:
    from torchft.coordination import LighthouseServer

    work.mkdir(parents=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    victim = args.jobs - 1
    fault_args = {"kill": ["--kill-in-round", "2"], "nan": ["--nan-from-step", "0"], "freeze": [], None: []}[fault]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONPATH": str(REPO)}
    jobs = [subprocess.Popen([sys.executable, str(SCRIPT), "--lighthouse", lighthouse.address(), "--job", str(j),
                              "--steps", str(args.steps), "--local-steps", str(args.local_steps), "--timeout",
                              str(args.timeout), "--step-s", str(args.step_s), "--sync", str(work), "--out",
                              str(work / f"job{j}.json"), *(fault_args if j == victim else [])],
                             env=env, stdout=open(work / f"job{j}.log", "w"), stderr=subprocess.STDOUT)
            for j in range(args.jobs)]
    start = time.monotonic()
    while not all((work / f"ready{j}").exists() for j in range(args.jobs)) and time.monotonic() - start < 120:
        time.sleep(0.05)
    go = time.monotonic()
    for j in range(args.jobs):  # how many start together: they meet again once connected (tests/scripts/torchft_job.py)
        (work / f"go{j}.tmp").write_text(str(args.jobs))
        (work / f"go{j}.tmp").rename(work / f"go{j}")
    survivors = jobs if fault is None else jobs[:-1]
    frozen = False
    hang = False
    while any(p.poll() is None for p in survivors):
        if fault == "freeze" and not frozen and _rounds(work, 0) >= 2:
            jobs[victim].send_signal(signal.SIGSTOP)
            frozen = True
        if time.monotonic() - go > args.deadline:
            hang = True
            break
        time.sleep(0.05)
    wall = time.monotonic() - go
    for p in jobs:
        if p.poll() is None:
            p.kill()
        p.wait()
    lighthouse.shutdown()
    codes = [p.returncode for p in survivors]
    results = [json.loads((work / f"job{j}.json").read_text()) if (work / f"job{j}.json").exists() else None
               for j in range(len(survivors))]
    states = [torch.load(work / f"job{j}.pt") if (work / f"job{j}.pt").exists() else None
              for j in range(len(survivors))]
    rounds = args.steps // args.local_steps
    same = all(s is not None for s in states) and all(
        max(float((s[k] - states[0][k]).abs().max()) for k in s) < 1e-5 for s in states)
    ok = (not hang and codes == [0] * len(survivors) and all(r and r["round"] == rounds for r in results) and same)
    return {"fault": fault, "ok": ok, "hang": hang, "wall_s": wall, "codes": codes,
            "loss": held_out_loss(states[0]) if ok else None,
            "discarded": [r["discarded"] if r else None for r in results]}


def _rounds(work: Path, job: int) -> int:
    path = work / f"rounds{job}"
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21, help="fault-injected runs (the faults in turn)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=10.0, help="TorchFT(timeout=...): bounds a round.s allreduce")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds after which a run counts as hung")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "torchft_stress.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = one_run(args, Path(tmp) / "fault_free", None)
        print("fault-free", baseline, flush=True)
        for i in range(args.runs):
            runs.append(one_run(args, Path(tmp) / f"run{i}", FAULTS[i % len(FAULTS)]))
            print(i, runs[-1], flush=True)
    print(f"{'fault':8} {'runs':>5} {'passed':>7} {'hangs':>6} {'longest s':>10} {'loss / fault-free (max)':>24}")
    for fault in FAULTS:
        rows = [r for r in runs if r["fault"] == fault]
        ratios = [r["loss"] / baseline["loss"] for r in rows if r["loss"] is not None and baseline["loss"]]
        print(f"{fault:8} {len(rows):5d} {sum(r['ok'] for r in rows):7d} {sum(r['hang'] for r in rows):6d} "
              f"{max((r['wall_s'] for r in rows), default=0):10.1f} {max(ratios, default=float('nan')):24.4f}")
    args.out.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "fault_free": baseline,
                                    "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
