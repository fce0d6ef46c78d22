"""Benchmark 6, workers that come and go (issue 16): wall-clock and final loss of asynchronous Local-SGD on four
workers when one of them is SIGKILLed at 50 % of the budget, against no failure and against today's single-job
mode, where the same kill ends the whole job (``--workers`` changes the four; the tests' quick run uses two).

Arms (the regression task of the tests, ``LinearModel``; each step padded by ``--step-s`` of emulated compute):

- ``elastic, no failure``: an ``OuterService`` and four ``ElasticWorkerStrategy`` jobs;
- ``elastic, one killed at 50 %``: the same; worker 4 is SIGKILLed from outside once the service has counted half
  of the budget (its unfinished round is lost, the other three finish the budget);
- ``single job, one killed at 50 %``: ``AsyncLocalSGDStrategy`` on ``devices=4``; rank 3 SIGKILLs itself at half of
  its share of the budget, and Lightning's launcher ends the job.

Wall-clock is from launching the processes to the last one exiting (Python and Lightning start-up included, the
same in every arm). Run: ``python benchmarks/elastic.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish
from benchmarks.plots import plot_bars

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_run.py"
NAME = "elastic"


def launch(role: str, out: Path, *args: str) -> subprocess.Popen:
    """Start one process of an elastic run (tests/scripts/elastic_run.py ``role``), its output in ``out``.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, str(SCRIPT), role, "--out", str(out), *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(path: Path) -> dict:
    """A JSON file a process writes, or ``{}`` while it is missing or half-written."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def elastic(args: argparse.Namespace, work: Path, kill: bool) -> dict:
    address = f"127.0.0.1:{free_port()}"
    common = ["--address", address, "--budget", str(args.budget), "--local-steps", str(args.local_steps)]
    start = time.perf_counter()
    server = launch("server", work / "server.json", *common, "--checkpoint", str(work / "ckpt.pt"))
    workers = [launch("worker", work / f"w{i}.json", "--address", address, "--step-s", str(args.step_s))
               for i in range(args.workers)]
    killed_at = None
    while kill and killed_at is None and server.poll() is None:
        done = read_json(work / "ckpt.pt.status.json").get("steps_done", 0)
        if done >= args.budget // 2:
            workers[-1].send_signal(signal.SIGKILL)
            killed_at = done
        time.sleep(0.05)
    codes = [p.wait(timeout=args.timeout) for p in (*workers, server)]
    result = read_json(work / "server.json")
    return {"wall_s": time.perf_counter() - start, "final_loss": result.get("final_loss"),
            "initial_loss": result.get("initial_loss"), "steps_done": result.get("steps_done"),
            "service_s": result.get("elapsed_s"), "killed_at_steps": killed_at, "exit_codes": codes,
            "job_lost": codes[-1] != 0}


def single_job(args: argparse.Namespace, work: Path) -> dict:
    start = time.perf_counter()
    job = launch("single", work / "single.json", "--budget", str(args.budget), "--local-steps", str(args.local_steps),
                 "--step-s", str(args.step_s), "--kill-at-step", str(args.budget // (2 * args.workers)),
                 "--address", "unused:0", "--workers", str(args.workers), "--start-method", args.single_start_method)
    code = job.wait(timeout=args.timeout)
    result = read_json(work / "single.json")
    return {"wall_s": time.perf_counter() - start, "final_loss": result.get("final_loss"), "steps_done": None,
            "service_s": None, "killed_at_steps": args.budget // 2, "exit_codes": [code], "job_lost": code != 0}


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    headers = ["arm", "job finished", "inner steps done / budget", "final loss (global model)", "wall-clock s",
               "service s (first session → end)"]
    body = [[arm, "no (job lost)" if r["job_lost"] else "yes", f"{r['steps_done'] or '—'} / {args.budget}",
             fmt(r["final_loss"], ".2e") if r["final_loss"] is not None else "— (no model)", fmt(r["wall_s"], ".1f"),
             fmt(r["service_s"], ".1f")] for arm, r in rows.items()]
    initial = next((r["initial_loss"] for r in rows.values() if r.get("initial_loss")), None)
    head = (f"Mode: {'quick' if args.quick else 'full'}; {args.workers} workers, budget {args.budget} inner steps, H = "
            f"{args.local_steps}, {args.step_s} s of emulated compute per step; initial loss {fmt(initial, '.3f')}.")
    return head + "\n\n" + markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=None, help="inner steps over all workers (default 800, quick 240)")
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workers", type=int, default=4, choices=range(2, 17), metavar="W",
                        help="workers in each arm, the single job's ranks (default 4)")
    parser.add_argument("--single-start-method", default="popen", choices=("popen", "spawn", "fork"),
                        help="how the single job starts its ranks (default: Lightning's subprocess launcher, as a "
                             "user runs it; the tests fork them, which spares W - 1 interpreter start-ups)")
    add_output_args(parser)
    args = parser.parse_args()
    args.budget = args.budget or (240 if args.quick else 800)
    name, _ = begin(NAME, args.quick)
    rows, of = {}, f"one of {args.workers} killed at 50 %"
    with tempfile.TemporaryDirectory() as tmp:
        for arm, run in (("elastic, no failure", lambda w: elastic(args, w, kill=False)),
                         (f"elastic, {of}", lambda w: elastic(args, w, kill=True)),
                         (f"single job (today), {of}", lambda w: single_job(args, w))):
            work = Path(tmp) / arm.split(",")[0].replace(" ", "_") / str(len(rows))
            work.mkdir(parents=True)
            rows[arm] = run(work)
            print(arm, rows[arm], flush=True)
    plot = plot_bars(args.docs_dir / "img" / f"{name}.png",
                     {"inner steps done": {arm: r.get("steps_done") for arm, r in rows.items()}},
                     f"{args.workers} async workers, budget {args.budget} inner steps")
    publish(name, args, {"rows": rows}, table(rows, args) + f"\n\n![{name}](img/{plot.name})\n")


if __name__ == "__main__":
    main()
