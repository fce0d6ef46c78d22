"""Benchmark 6, workers that come and go (issues 16 and 61): final loss, wall-clock, time lost to the fault and
bytes of four workers when one is SIGKILLed at 50 % of the run, or joins at 50 %, on each engine; and the CPU time
per inner step that torchft adds inside a job (``--workers`` changes the four).

Arms (the regression task of the tests, ``LinearModel``; each step padded by ``--step-s`` of emulated compute):

- ``OuterService async`` (``ElasticWorkerStrategy`` workers; asynchronous Local-SGD, which only the service does):
  no fault, the last worker SIGKILLed once the service counted half of the budget (inner steps over all workers),
  the last worker joining then;
- ``torchft DiLoCo`` (``TorchFTStrategy`` jobs of one process, a Lighthouse in this process, ``min_replicas=2``):
  the same three cases, each job ``budget / workers`` steps; the fault lands once job 0 committed half its rounds;
- ``single job`` (``AsyncLocalSGDStrategy``, ``devices=4``): DiLoCo without a fault (the CPU baseline) and async
  with rank 3 SIGKILLed at half of its share (Lightning's launcher ends the job).

Every worker or job is started, imports, says it is ready and waits; the clock starts when they all go (a joining
one is held until its moment), so start-ups are left out; the single job's wall-clock includes its start-up.
*Time lost to the fault*: the arm's wall-clock less its engine's fault-free one (a joining torchft job adds work
without lengthening the run; a joining service worker shares the budget). *Bytes*: payload on the wire, every
byte counted once: the service's pushes and pulls (its counters); torchft's allreduces as a ring moves them
(``2 (k - 1) S`` per round of ``k`` jobs and ``S`` bytes, computed) plus each heal's state. *CPU per inner step*:
process CPU (every thread's) from a step's start to the next one's, rounds left out.
Run: ``python benchmarks/elastic.py [--quick]``. ``--cpu-ab N`` runs only the CPU comparison: the fault-free DiLoCo
arms (the single job, torchft at ``heartbeat_s`` 0.5 and 0.1 s) N times each, interleaved (their order rotated every
repetition), so a machine whose load drifts weighs on every arm alike; it prints its stamped table and writes its
JSON (not a ``make bench`` part).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish, stamp, write_json

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_run.py"
NAME = "elastic"
os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process: its quorum log at INFO drowns the tables
FAULTS = (None, "kill", "join")


def launch(role: str, out: Path, *args: str) -> subprocess.Popen:
    """Start one process of an elastic run (tests/scripts/elastic_run.py ``role``), its output in ``out``.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "RUST_LOG": "warn"}
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


def cpu_samples(work: Path) -> list[float]:
    return [s for f in sorted(work.glob("*.cpu*.json")) for s in json.loads(f.read_text())]


def start_together(procs: list, outs: list[Path], go: Path, timeout: float) -> float:
    """Wait until every process in ``procs`` is ready (imports done), let them go; the start time."""
    deadline = time.monotonic() + timeout
    while not all(o.with_suffix(".ready").exists() for o in outs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"not all of {outs} became ready")
        time.sleep(0.05)
    go.touch()
    return time.perf_counter()


def inject(fault: str | None, victim: subprocess.Popen, go: Path, progress, half: float, alive) -> float | None:
    """Wait until ``progress()`` reaches ``half``, then kill the victim or let it join; when it happened."""
    while fault is not None and alive():
        done = progress()
        if done >= half:
            if fault == "kill":
                victim.send_signal(signal.SIGKILL)
            go.touch()
            return done
        time.sleep(0.05)
    return None


def service(args: argparse.Namespace, work: Path, fault: str | None) -> dict:
    address = f"127.0.0.1:{free_port()}"
    server = launch("server", work / "server.json", "--address", address, "--budget", str(args.budget),
                    "--local-steps", str(args.local_steps), "--checkpoint", str(work / "ckpt.pt"),
                    "--max-idle-s", "30")  # a run that never spends its budget ends 30 s after its last worker left
    go, outs = work / "go", [work / f"w{i}.json" for i in range(args.workers)]
    # A worker joining at 50 %: the others hold a round past their share of the first half until it has registered
    # (else a quick run's budget is spent before it starts, and it waits out its reconnect_s); counted in wall-clock.
    held = (math.ceil(args.budget / 2 / (args.workers - 1) / args.local_steps) + 1) * args.local_steps
    hold = ("--hold-at", str(held), "--hold-until", str(work / "joined"))
    workers = [launch("worker", out, "--address", address, "--step-s", str(args.step_s), "--local-steps",
                      str(args.local_steps), "--go", str(go.with_suffix(".late" if late else ".all")),
                      *(() if fault != "join" else ("--mark-joined", str(work / "joined")) if late else hold))
               for out, late in zip(outs, [False] * (args.workers - 1) + [fault == "join"])]
    start = start_together(workers, outs[: args.workers - (fault == "join")], go.with_suffix(".all"), args.timeout)
    at = inject(fault, workers[-1], go.with_suffix(".late"),
                lambda: read_json(work / "ckpt.pt.status.json").get("steps_done", 0),
                args.budget // 2, lambda: server.poll() is None)
    codes = [p.wait(timeout=args.timeout) for p in (*workers, server)]
    result = read_json(work / "server.json")
    stats = result.get("workers", {}).values()
    return {"wall_s": time.perf_counter() - start, "final_loss": result.get("final_loss"),
            "initial_loss": result.get("initial_loss"), "steps_done": result.get("steps_done"), "fault_at": at,
            "bytes": sum(s["push_bytes"] + s["pull_bytes"] for s in stats) if stats else None,
            "exit_codes": codes,  # the server's and every worker's but the killed one's
            "job_lost": any(c != 0 for i, c in enumerate(codes) if not (fault == "kill" and i == args.workers - 1))}


def torchft(args: argparse.Namespace, work: Path, fault: str | None, heartbeat_s: float = 0.5) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    go, outs = work / "go", [work / f"job{j}.json" for j in range(args.workers)]
    rounds = args.budget // args.workers // args.local_steps
    # A job joining at 50 %: the others hold at the end of the round after it (until its quorum request is out), so a
    # slow start-up on a loaded machine cannot miss the run's last quorum; the hold counts in the arm's wall-clock.
    hold = ("--hold-at", str((rounds // 2 + 1) * args.local_steps), "--hold-until", str(work / "joined"))
    jobs = [launch("torchft", out, "--lighthouse", lighthouse.address(), "--job", str(j), "--budget", str(args.budget),
                   "--workers", str(args.workers), "--local-steps", str(args.local_steps), "--step-s", str(args.step_s),
                   "--progress", str(work / f"rounds{j}"), "--go", str(go.with_suffix(".late" if late else ".all")),
                   "--heartbeat-s", str(heartbeat_s),
                   *(() if fault != "join" else ("--mark-joined", str(work / "joined")) if late else hold))
            for j, (out, late) in enumerate(zip(outs, [False] * (args.workers - 1) + [fault == "join"]))]
    start = start_together(jobs, outs[: args.workers - (fault == "join")], go.with_suffix(".all"), args.timeout)
    at = inject(fault, jobs[-1], go.with_suffix(".late"), lambda: int(read_json(work / "rounds0") or 0), rounds // 2,
                lambda: jobs[0].poll() is None)
    codes = [p.wait(timeout=args.timeout) for p in jobs]
    lighthouse.shutdown()
    results = [read_json(work / f"job{j}.json") for j in range(args.workers)]
    survivors = results[:-1] if fault == "kill" else results
    return {"wall_s": time.perf_counter() - start, "final_loss": results[0].get("final_loss"),
            "steps_done": sum(r.get("steps_done", 0) for r in results) + (at or 0) * args.local_steps * (fault == "kill"),
            "fault_at": at and at * args.local_steps * args.workers,
            "bytes": sum(r.get("bytes", 0) for r in results) or None,
            "discarded": [r.get("discarded") for r in survivors], "healed": [r.get("healed") for r in results],
            "exit_codes": codes, "job_lost": any(c != 0 for c in (codes[:-1] if fault == "kill" else codes)),
            "cpu_per_step": cpu_samples(work) if fault is None else None}


def single_job(args: argparse.Namespace, work: Path, mode: str, kill: bool) -> dict:
    start = time.perf_counter()
    job = launch("single", work / "single.json", "--budget", str(args.budget), "--local-steps", str(args.local_steps),
                 "--step-s", str(args.step_s), "--kill-at-step", str(args.budget // (2 * args.workers) if kill else 0),
                 "--mode", mode, "--workers", str(args.workers), "--start-method", args.single_start_method)
    code = job.wait(timeout=args.timeout)
    result = read_json(work / "single.json")
    return {"wall_s": time.perf_counter() - start, "final_loss": result.get("final_loss"),
            "steps_done": None if kill else args.budget, "fault_at": args.budget // 2 if kill else None, "bytes": None,
            "exit_codes": [code], "job_lost": code != 0, "cpu_per_step": None if kill else cpu_samples(work)}


def arms(args: argparse.Namespace) -> dict:
    """Each arm's label and how it runs (a function of its working directory)."""
    of = f"one of {args.workers}"
    nth = f"{args.workers}{'rd' if args.workers == 3 else 'th'}"  # W is 3 to 16
    label = {None: "no fault", "kill": f"{of} killed at 50 %", "join": f"the {nth} joining at 50 %"}
    out = {}
    for fault in FAULTS:
        out[f"OuterService async, {label[fault]}"] = lambda w, f=fault: service(args, w, f)
    for fault in FAULTS:
        out[f"torchft DiLoCo, {label[fault]}"] = lambda w, f=fault: torchft(args, w, f)
    out["single job DiLoCo, no fault"] = lambda w: single_job(args, w, "sync", kill=False)
    out[f"single job async, {label['kill']}"] = lambda w: single_job(args, w, "async", kill=True)
    return out


def lost(rows: dict[str, dict], arm: str) -> float | None:
    """The arm's wall-clock less its engine's fault-free arm's."""
    base = rows.get(arm.split(",")[0] + ", no fault")
    if base is None or base is rows[arm] or rows[arm]["job_lost"]:
        return None
    return rows[arm]["wall_s"] - base["wall_s"]


def cpu_row(name: str, samples: list[float], base: list[float] | None) -> list[str]:
    mean, se = statistics.fmean(samples), statistics.stdev(samples) / len(samples) ** 0.5
    q = statistics.quantiles(samples, n=4)
    ratio = "1 (baseline)" if base is None else f"{mean / statistics.fmean(base):.2f}"
    return [name, str(len(samples)), f"{1e3 * mean:.2f} ± {1e3 * se:.2f}", f"{1e3 * q[1]:.2f}",
            f"{1e3 * q[0]:.2f}–{1e3 * q[2]:.2f}", ratio]


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    headers = ["arm", "finished", "inner steps done", "final loss (global model)", "wall-clock s",
               "time lost to the fault s", "payload bytes"]
    body = [[arm, "no (job lost)" if r["job_lost"] else "yes", str(r["steps_done"] or "—"),
             fmt(r["final_loss"], ".2e") if r["final_loss"] is not None else "— (no model)", fmt(r["wall_s"], ".1f"),
             fmt(lost(rows, arm), "+.1f") if lost(rows, arm) is not None else "—",
             f"{r['bytes']:,}" if r["bytes"] else "—"] for arm, r in rows.items()]
    initial = next((r["initial_loss"] for r in rows.values() if r.get("initial_loss")), None)
    head = (f"Mode: {'quick' if args.quick else 'full'}; {args.workers} workers, budget {args.budget} inner steps "
            f"(torchft and the single job: {args.budget // args.workers} per job), H = {args.local_steps}, "
            f"{args.step_s} s of emulated compute per step; initial loss {fmt(initial, '.3f')}.")
    base = rows.get("single job DiLoCo, no fault", {}).get("cpu_per_step")
    ft = rows.get("torchft DiLoCo, no fault", {}).get("cpu_per_step")
    cpu = ""
    if base and ft:
        cpu = ("\n\nCPU time per inner step between rounds (ms, every process of the fault-free arm; mean ± its "
               "standard error):\n\n" + markdown_table(
                   ["arm", "steps", "mean ms", "median ms", "quartiles ms", "mean ÷ DiLoCo's"],
                   [cpu_row("single job DiLoCo (AsyncLocalSGDStrategy)", base, None),
                    cpu_row("torchft DiLoCo (TorchFTStrategy)", ft, base)]))
    return head + "\n\n" + markdown_table(headers, body) + cpu


def cpu_ab(args: argparse.Namespace, tmp: Path) -> dict[str, list[list[float]]]:
    """The fault-free DiLoCo arms only, interleaved: each repetition runs the single job and torchft at 0.5 s and
    0.1 s heartbeats, in an order rotated every repetition (a machine whose load drifts loads every arm alike)."""
    runs = {"single job DiLoCo": lambda w: single_job(args, w, "sync", kill=False),
            "torchft DiLoCo, heartbeat_s=0.5": lambda w: torchft(args, w, None, 0.5),
            "torchft DiLoCo, heartbeat_s=0.1": lambda w: torchft(args, w, None, 0.1)}
    names, samples = list(runs), {name: [] for name in runs}
    for rep in range(args.cpu_ab):
        for name in names[rep % 3:] + names[: rep % 3]:
            work = tmp / f"{rep}-{names.index(name)}"
            work.mkdir(parents=True)
            row = runs[name](work)
            samples[name].append(row["cpu_per_step"] if not row["job_lost"] else [])
            print(rep, name, f"{1e3 * statistics.fmean(samples[name][-1] or [math.nan]):.3f} ms", flush=True)
    return samples


def cpu_ab_table(samples: dict[str, list[list[float]]], args: argparse.Namespace) -> str:
    """Per repetition each arm's mean ± its standard error and its ratio to the single job's, then the spread."""
    base = samples["single job DiLoCo"]
    body = []
    for name, reps in samples.items():
        ratios = [statistics.fmean(r) / statistics.fmean(b) for r, b in zip(reps, base) if r and b]
        cells = [f"{1e3 * statistics.fmean(r):.2f} ± {1e3 * statistics.stdev(r) / len(r) ** 0.5:.2f}" if len(r) > 1
                 else "— (lost)" for r in reps]
        spread = "1 (baseline)" if reps is base else (
            f"{statistics.fmean(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "—")
        body.append([name, *cells, spread])
    head = (f"CPU time per inner step between rounds, interleaved A/B ({args.cpu_ab} repetitions, the arms' order "
            f"rotated each one): {args.workers} workers, {args.budget // args.workers} steps per job, H = "
            f"{args.local_steps}, {args.step_s} s of emulated compute per step; ms, every process's steps, mean ± "
            "its standard error; the last column: mean of the per-repetition ratios to the single job (min–max).")
    headers = ["arm", *[f"rep {i + 1}" for i in range(args.cpu_ab)], "÷ single job"]
    return head + "\n\n" + markdown_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=None, help="inner steps over all workers (default 800, quick 240)")
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workers", type=int, default=4, choices=range(3, 17), metavar="W",
                        help="workers in each arm, the single job's ranks (default 4)")
    parser.add_argument("--single-start-method", default="popen", choices=("popen", "spawn", "fork"),
                        help="how the single job starts its ranks (default: Lightning's subprocess launcher, as a "
                             "user runs it; the tests fork them, which spares W - 1 interpreter start-ups)")
    parser.add_argument("--cpu-ab", type=int, default=0, metavar="N",
                        help="only the CPU A/B: N interleaved repetitions of the fault-free DiLoCo arms (the single "
                             "job, torchft at heartbeat_s 0.5 and 0.1)")
    add_output_args(parser)
    args = parser.parse_args()
    args.budget = args.budget or (240 if args.quick else 800)
    if args.budget // args.workers % args.local_steps:  # torchft refuses it, and the join arm's joiner would wait
        parser.error(f"--budget {args.budget} / --workers {args.workers} must be a multiple of --local-steps "
                     f"{args.local_steps} (every torchft job runs whole rounds)")
    if args.budget // args.workers // args.local_steps < 4:  # the joining job needs a round after the others' hold
        parser.error(f"--budget {args.budget} gives {args.budget // args.workers // args.local_steps} rounds per job "
                     f"at --workers {args.workers} --local-steps {args.local_steps}: at least 4 are needed")
    if args.cpu_ab:
        name, _ = begin(NAME + "_cpu_ab", args.quick)
        with tempfile.TemporaryDirectory() as tmp:
            samples = cpu_ab(args, Path(tmp))
        # not a `make bench` part: the JSON and the stamped table, no docs block (a research note quotes it)
        write_json(name, {"config": {k: str(v) for k, v in vars(args).items()}, "samples": samples}, args.results_dir)
        return print(f"{cpu_ab_table(samples, args)}\n\n{stamp([])}", flush=True)
    name, _ = begin(NAME, args.quick)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm, run in arms(args).items():
            work = Path(tmp) / str(len(rows))
            work.mkdir(parents=True)
            rows[arm] = run(work)
            print(arm, {k: v for k, v in rows[arm].items() if k != "cpu_per_step"}, flush=True)
    publish(name, args, {"rows": rows}, table(rows, args))


if __name__ == "__main__":
    main()
