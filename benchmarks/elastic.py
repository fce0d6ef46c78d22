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
Run: ``python benchmarks/elastic.py [--quick]``. ``--cpu-ab N`` runs only the CPU comparison (its own block,
``elastic_cpu``): the fault-free DiLoCo arms (the single job; torchft at each ``--cpu-heartbeats`` interval, 0.5 s
by default) N times each at each H of ``--cpu-h``, interleaved (their order rotated every repetition), so a machine
whose load drifts weighs on every arm alike; per H the paired ratio to the single job with its 95 % interval.
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

from benchmarks import forked
from benchmarks.common import add_output_args, begin, fmt, markdown_table, publish

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_run.py"
NAME = "elastic"
os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process: its quorum log at INFO drowns the tables
FAULTS = (None, "kill", "join")


def launch(role: str, out: Path, *args: str, fork: bool = False) -> subprocess.Popen | forked.Forked:
    """Start one process of an elastic run (tests/scripts/elastic_run.py ``role``), its output in ``out``.log;
    ``fork``: forked from an interpreter with torch and Lightning imported (:mod:`benchmarks.forked`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "RUST_LOG": "warn"}
    argv = [role, "--out", str(out), *args]
    if fork:
        return forked.start(str(SCRIPT), argv, env, str(out.with_suffix(".log")))
    log = open(out.with_suffix(".log"), "w")
    return subprocess.Popen([sys.executable, str(SCRIPT), *argv], stdout=log, stderr=subprocess.STDOUT, env=env)


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


def inject(fault: str | None, victim: subprocess.Popen | forked.Forked, go: Path, progress, half: float,
           alive) -> float | None:
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
                    "--max-idle-s", "30",  # a run that never spends its budget ends 30 s after its last worker left
                    fork=args.launch == "fork")
    go, outs = work / "go", [work / f"w{i}.json" for i in range(args.workers)]
    # A worker joining at 50 %: the others hold a round past their share of the first half until it has registered
    # (else a quick run's budget is spent before it starts, and it waits out its reconnect_s); counted in wall-clock.
    held = (math.ceil(args.budget / 2 / (args.workers - 1) / args.local_steps) + 1) * args.local_steps
    hold = ("--hold-at", str(held), "--hold-until", str(work / "joined"))
    workers = [launch("worker", out, "--address", address, "--step-s", str(args.step_s), "--local-steps",
                      str(args.local_steps), "--go", str(go.with_suffix(".late" if late else ".all")),
                      *(() if fault != "join" else ("--mark-joined", str(work / "joined")) if late else hold),
                      fork=args.launch == "fork")
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


def torchft(args: argparse.Namespace, work: Path, fault: str | None, heartbeat_s: float = 0.5,
            join_timeout_ms: int = 1000) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=join_timeout_ms,
                                  heartbeat_timeout_ms=2000)
    go, outs = work / "go", [work / f"job{j}.json" for j in range(args.workers)]
    rounds = args.budget // args.workers // args.local_steps
    # A job joining at 50 %: the others hold at the end of the round after it (until its quorum request is out), so a
    # slow start-up on a loaded machine cannot miss the run's last quorum; the hold counts in the arm's wall-clock.
    hold = ("--hold-at", str((rounds // 2 + 1) * args.local_steps), "--hold-until", str(work / "joined"))
    jobs = [launch("torchft", out, "--lighthouse", lighthouse.address(), "--job", str(j), "--budget", str(args.budget),
                   "--workers", str(args.workers), "--local-steps", str(args.local_steps), "--step-s", str(args.step_s),
                   "--progress", str(work / f"rounds{j}"), "--go", str(go.with_suffix(".late" if late else ".all")),
                   "--heartbeat-s", str(heartbeat_s),
                   *(() if fault != "join" else ("--mark-joined", str(work / "joined")) if late else hold),
                   fork=args.launch == "fork")
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
                 "--mode", mode, "--workers", str(args.workers), "--start-method", args.single_start_method,
                 fork=args.launch == "fork")
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


def load_1min() -> float:
    """The machine's 1-minute load average (what else runs on it; ``nan`` where /proc is missing)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan


def cpu_ab(args: argparse.Namespace, tmp: Path) -> dict[str, dict]:
    """The fault-free DiLoCo arms only, at each H of ``--cpu-h``, interleaved: every repetition runs, at each H, the
    single job and torchft at each ``--cpu-heartbeats`` interval, the arms' order rotated every repetition (a machine
    whose load drifts loads every arm alike). Per H and arm: each repetition's CPU samples and the 1-minute load
    average at its end."""
    names = ["single job DiLoCo", *(f"torchft DiLoCo, heartbeat_s={s:g}" for s in args.cpu_heartbeats)]
    out = {str(h): {"samples": {n: [] for n in names}, "load": {n: [] for n in names}} for h in args.cpu_h}
    for rep in range(args.cpu_ab):
        for h in args.cpu_h:
            at = argparse.Namespace(**{**vars(args), "local_steps": h})
            runs = [lambda w: single_job(at, w, "sync", kill=False),
                    # a join timeout past any drift between the jobs: a live job later than it at a round's
                    # shrink-only quorum is left out and then waits out its quorum_timeout (seen at H = 50 under
                    # load 25-30, research log 2026-12-07); the quorum waits are rounds, not in the samples
                    *(lambda w, s=s: torchft(at, w, None, s, join_timeout_ms=30_000) for s in args.cpu_heartbeats)]
            for i in [*range(rep % len(names), len(names)), *range(rep % len(names))]:
                work = tmp / f"H{h}-{rep}-{i}"
                work.mkdir(parents=True)
                row = runs[i](work)
                out[str(h)]["samples"][names[i]].append([] if row["job_lost"] else row["cpu_per_step"])
                out[str(h)]["load"][names[i]].append(load_1min())
                print(rep, f"H={h}", names[i], f"{1e3 * statistics.fmean(row['cpu_per_step'] or [math.nan]):.3f} ms",
                      f"load {out[str(h)]['load'][names[i]][-1]}", flush=True)
    return out


def t_quantile(p: float, df: int) -> float:
    """Student's t distribution's ``p`` quantile (``p`` > 0.5): bisection of its CDF, the density integrated by
    Simpson's rule (the benchmark's environment has no scipy)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, n: int = 400) -> float:
        w = [1 if i in (0, n) else 4 if i % 2 else 2 for i in range(n + 1)]
        return 0.5 + x / n / 3 * sum(wi * c * (1 + (i * x / n) ** 2 / df) ** (-(df + 1) / 2) for i, wi in enumerate(w))

    lo, hi = 0.0, 64.0
    for _ in range(50):
        lo, hi = ((lo + hi) / 2, hi) if cdf((lo + hi) / 2) < p else (lo, (lo + hi) / 2)
    return (lo + hi) / 2


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Mean of ``a[i] - b[i]`` with its 95 % t interval over the pairs (``nan`` bounds with fewer than two)."""
    d = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(d)
    if len(d) < 2:
        return mean, math.nan, math.nan
    half = t_quantile(0.975, len(d) - 1) * statistics.stdev(d) / len(d) ** 0.5
    return mean, mean - half, mean + half


def cpu_ab_rows(h: str, run: dict) -> list[list[str]]:
    """One row per torchft arm at H = ``h``: each arm's median over repetitions of its mean CPU per inner step, the
    ratio of the medians, the paired ratios' geometric mean with its 95 % t interval (over log ratios), whether the
    interval holds 1, and the paired difference in ms with its interval."""
    samples = run["samples"]
    base = samples["single job DiLoCo"]
    rows = []
    for name, reps in samples.items():
        if reps is base:
            continue
        pairs = [(statistics.fmean(r), statistics.fmean(b)) for r, b in zip(reps, base) if r and b]
        if not pairs:
            rows.append([h, name, "0", *["—"] * 6])
            continue
        ft, single = [p[0] for p in pairs], [p[1] for p in pairs]
        g, lo, hi = (math.exp(v) for v in paired([math.log(x) for x in ft], [math.log(x) for x in single]))
        d, dlo, dhi = (1e3 * v for v in paired(ft, single))
        verdict = "—" if math.isnan(lo) else "yes" if lo <= 1 <= hi else f"no ({100 * (g - 1):+.0f} %)"
        rows.append([h, name, str(len(pairs)), f"{1e3 * statistics.median(single):.2f}",
                     f"{1e3 * statistics.median(ft):.2f}", f"{statistics.median(ft) / statistics.median(single):.3f}",
                     f"{g:.3f} [{lo:.3f}, {hi:.3f}]", verdict, f"{d:+.3f} [{dlo:+.3f}, {dhi:+.3f}]"])
    return rows


def cpu_ab_table(runs: dict[str, dict], args: argparse.Namespace) -> str:
    """Per H the interleaved A/B's summary (:func:`cpu_ab_rows`), the machine's load in the head."""
    loads = [x for run in runs.values() for arm in run["load"].values() for x in arm if not math.isnan(x)]
    load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "unknown"
    head = (f"CPU time per inner step between rounds, interleaved A/B: {args.cpu_ab} repetitions, each running every "
            f"arm at every H in an order rotated each repetition; {args.workers} jobs (the single job: "
            f"{args.workers} ranks), {args.budget // args.workers} steps per job, {args.step_s} s of emulated compute "
            f"per step; a repetition's arm: the mean over every process's steps (the first round's left out). "
            f"Pairs: the same repetition and H; the interval: 95 %, Student's t over pairs. Machine load (1-minute "
            f"average at each arm's end): {load}.")
    headers = ["H", "torchft arm", "pairs", "single job ms (median)", "torchft ms (median)", "ratio of medians",
               "paired ratio [95 %]", "within noise", "difference ms per step [95 %]"]
    return head + "\n\n" + markdown_table(headers, [row for h, run in runs.items() for row in cpu_ab_rows(h, run)])


def check_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace, flag: str, h: int, least: int,
                 why: str) -> None:
    """Refuse a budget that is not whole rounds of ``h`` steps per job, or fewer than ``least`` of them."""
    per_job = args.budget // args.workers
    if per_job % h:  # torchft refuses it, and the join arm's joiner would wait
        parser.error(f"--budget {args.budget} / --workers {args.workers} = {per_job} steps per job must be a "
                     f"multiple of {flag} {h} (every torchft job runs whole rounds)")
    if per_job // h < least:
        parser.error(f"--budget {args.budget} gives {per_job // h} rounds per job at --workers {args.workers} "
                     f"{flag} {h}: at least {least} are needed ({why})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--launch", default="exec", choices=("exec", "fork"),
                        help="how every process of an arm starts (default: a new interpreter each, as a user runs "
                             "them; fork: forked from one that imported torch and Lightning once, which spares each "
                             "~4 s of imports, the single job's start-up included: the tests' choice)")
    parser.add_argument("--cpu-ab", type=int, default=0, metavar="N",
                        help="only the CPU A/B: N interleaved repetitions of the fault-free DiLoCo arms (the single "
                             "job, torchft at each --cpu-heartbeats) at each --cpu-h")
    parser.add_argument("--cpu-h", type=int, nargs="+", default=None, metavar="H",
                        help="with --cpu-ab: the H (inner steps per round) to compare at (default: --local-steps); "
                             "--budget / --workers must be whole rounds of each")
    parser.add_argument("--cpu-heartbeats", type=float, nargs="+", default=None, metavar="S",
                        help="with --cpu-ab: one torchft arm per heartbeat_s (default: 0.5, TorchFT's default)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    args.budget = args.budget or (240 if args.quick else 800)
    if not args.cpu_ab:
        for flag in ("cpu_h", "cpu_heartbeats"):
            if getattr(args, flag) is not None:
                parser.error(f"--{flag.replace('_', '-')} sets the CPU A/B only: add --cpu-ab N (or leave it out)")
        check_rounds(parser, args, "--local-steps", args.local_steps, 4, "the joining job needs a round after the "
                     "others' hold")
        return args
    args.cpu_h = args.cpu_h or [args.local_steps]
    args.cpu_heartbeats = args.cpu_heartbeats or [0.5]
    for value in args.cpu_heartbeats:
        if not value > 0:
            parser.error(f"--cpu-heartbeats {value:g}: heartbeat_s must be > 0 seconds")
    for h in args.cpu_h:
        check_rounds(parser, args, "--cpu-h", h, 2, "the first round's steps are left out of the samples")
    return args


def main() -> None:
    args = parse_args()
    if args.cpu_ab:
        name, _ = begin(NAME + "_cpu", args.quick)
        with tempfile.TemporaryDirectory() as tmp:
            runs = cpu_ab(args, Path(tmp))
        return publish(name, args, {"runs": runs}, cpu_ab_table(runs, args))
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
