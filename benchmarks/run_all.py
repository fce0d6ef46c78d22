"""Run the benchmarks' parts in turn, each only when its cached result is stale (what ``make bench`` does).

``make bench`` runs the :data:`PARTS` marked ``bench``; ``make bench-full`` (``--full``) adds the research
tables. A part's result is cached under a key of its command and what the code it runs does (its syntax trees
without docstrings or comments, ``benchmarks/cache.py``): a part whose key and outputs are unchanged is skipped,
so an interrupted run resumes where it stopped and a second run with nothing changed only checks. Before running,
the plan is printed with an estimate of the time left on a 2-core machine (each part's last measured time where
known, else its estimate below).

Usage: ``python benchmarks/run_all.py [--full] [--parts NAME ...] [--force] [--dry-run] [--list]`` followed by
any options for every script (``--quick``, ``--results-dir DIR``, ``--docs-dir DIR``).
"""

from __future__ import annotations

import argparse
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cache import (
    REPO,
    key_inputs,
    key_of,
    outputs_of,
    read_record,
    snapshot,
    stale_reason,
    write_record,
)


@dataclass(frozen=True)
class Part:
    """One command of the benchmarks: ``python benchmarks/<script> <args>``.

    ``minutes``: its estimated wall-clock at full size on the 2-core machine (from the runs recorded in
    docs/benchmarks.md), used until a run measures it. ``full_size``: arguments given only at full size (they
    would override ``--quick``'s sizes). ``code``: other files it runs in subprocesses, hashed into its key
    with the script. ``full``: only in ``make bench-full``."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    minutes: float = 0.0
    full_size: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    full: bool = False

    def command(self, extra: Sequence[str] = ()) -> list[str]:
        """The command as the stamps record it (``python benchmarks/...``, the repository root as cwd)."""
        size = () if "--quick" in extra else self.full_size
        return ["python", f"benchmarks/{self.script}", *self.args, *size, *extra]


# Benchmark 2 (the LR search at equal compute): the baselines, and the HDET arms as vote rules. Edit these
# lists to move arms between `make bench` and `make bench-full`.
# "untuned" (plain DDP at the starting LR) is the price check of insurance (issue 28); the full-batch grid
# (grid ×G, the ceiling) runs from every start.
# Ray Tune's PBT runs on the first seed only (`--pbt-seeds 1`, 9 arms).
SEARCH_METHODS = ("untuned", "grid", "optuna_tpe", "pbt", "prodigy", "schedulefree")
# What a user of strategy="hdet" gets (nothing given). The same rules on the benchmark's own grid and T
# (pbt+search) and the alternatives (trust_region@global, pbt@global: they lost or drew in every cell of the
# insurance round, research log 2026-12-01) are in bench-full's search_remedies.
SEARCH_VOTES = ("defaults",)  # HDET as `strategy="hdet"` runs it with nothing set
# Every remedy of issue 13 that is still in the package side by side (bench-full), against the baselines that need
# no Ray (PB2, the reference group and the curve and held-out signals were removed: research log 2026-12-06).
REMEDY_METHODS = ("grid", "optuna_tpe", "prodigy", "schedulefree")
REMEDY_VOTES = ("pbt", "pbt+search", "pbt@global", "softmax")
# Schedule-free AdamW as the optimizer every search tunes (bench-full).
SF_METHODS = ("grid", "optuna_tpe", "pbt", "prodigy", "schedulefree")
SF_VOTES = ("softmax", "pbt", "pbt@global", "pbt+search")
# Issue 59's cells: the repeating workloads (>= 25 epochs in 300 steps of 4 x 32), starts 1x, 10x and 40x either
# way of the grid's best, untuned, grid, lr_find + DDP and HDET at its defaults, three seeds, one part per optimizer
# and schedule (bench-full). Another HDET variant: the same command with --hdet-votes defaults:OPTION=VALUE and
# another --name. Minutes: the first measurement (constant LR, 2026-12-06, 2 cores at load 10-17 from other jobs):
# tabular_small 8-12 min per optimizer (grid included), shapes_small 10-13 min without its grid and 11 with it
# alone: ~33 min a part there, about half on idle cores.
REPEAT_CELLS = ("--starts", "good", "10x low", "10x high", "40x low", "40x high", "--steps", "300", "--batch-size", "32",
                "--val-every", "30", "--seeds", "3")
REPEAT_ARGS = ("--workloads", "tabular_small", "shapes_small", *REPEAT_CELLS)


def repeat(optimizer: str, schedule: str) -> tuple[str, ...]:
    return search(f"search_repeat_{optimizer}_{schedule}", ("untuned", "grid", "lr_find"), ("defaults",),
                  "--optimizer", optimizer, "--schedule", schedule, *REPEAT_ARGS)


# Issue 59's other baselines on the AdamW-constant repeating cells, beside untuned, lr_find and HDET in one run
# (the grid is the adamw_constant part's): Optuna TPE, Ray Tune's PBT (seed 0 only, as benchmark 2's table),
# Prodigy, schedule-free AdamW. One seed and start took 1.3 min without PBT and PBT ~95 s an arm at load 3-11; the
# part took 46.5 min at load 11-18 (2026-12-06; 14.2 CPU-min counted, Ray's workers not among them).
def repeat_baselines() -> tuple[str, ...]:
    return search("search_repeat_baselines", ("untuned", "optuna_tpe", "pbt", "prodigy", "schedulefree", "lr_find"),
                  ("defaults",), "--optimizer", "adamw", "--schedule", "constant", "--pbt-seeds", "1", *REPEAT_ARGS)


def repeat_w8(optimizer: str, workload: str) -> tuple[str, ...]:
    """Issue 59's constant-LR cells at 8 processes (four groups of two ranks), one workload: untuned, lr_find + DDP
    and HDET at the good LRs measured at 4 (GOOD_LRS; the grid not rerun)."""
    return search(f"search_repeat_{optimizer}_constant_{workload}_w8", ("untuned", "lr_find"), ("defaults",),
                  "--optimizer", optimizer, "--schedule", "constant", "--world-size", "8", "--workloads", workload,
                  *REPEAT_CELLS)


# HDET's processes forked, as the tables' were: saves ~10 s of imports per run, changes no number but the
# wall-clock. The table's sizes (S = 128) apply at full size only.
SEARCH_FULL_SIZE = ("--steps", "128", "--pbt-interval", "32", "--val-every", "16")


# The crash benchmark (issue 28's price check), at 100-300x too high: HDET as a user runs it (`defaults`:
# strategy="hdet" exactly) beside `pbt+search` (the same but a vote every S/10 steps, the tables' arm before
# 2026-12-04; at 300 steps the defaults vote every 38 and crash where it learns: research log 2026-12-04), each ÷ the
# best of plain DDP at four LRs on all ranks (whose ends are the untuned run and DDP at the good LR), three
# workloads, three seeds, HDET's processes forked. The NaN-type failures and the published arms (warm start, ±11 %
# fan-out) are bench-full's `crash_published`.
CRASH_ARGS = ("--failures", "collapse", "--full-grid", "--hdet-votes", "", "--default-votes",
              "defaults,pbt+search", "--seeds", "3", "--start-method", "fork")
# Issue 43's overlap target: whole-model overlap (τ = 25 of H = 50) and staggered parts (F = 2, τ = 18) against the
# blocking exchange, two workers behind 12 and 6 Mbit/s, and on loopback (the blocking arm's time there is the best an
# overlap can reach: the table's "exchange time hidden"); research log 2026-12-05.
COMM_OVERLAP_ARGS = ("--name", "comm_overlap", "--start-method", "fork", "--workers", "2", "--steps", "300",
                     "--local-steps", "50", "--overlap-steps", "25", "--stagger", "2", "--stagger-overlap-steps", "18",
                     "--links", "0", "1.2e7", "6e6", "--arms", "diloco f32", "diloco f32 overlap", "diloco f32 stagger overlap",
                     "--seeds", "0", "1", "2")
# Issue 43's bytes target: SparseLoCo against DDP and float32 DiLoCo at H = 100, W = 4, loopback, three seeds.
COMM_SPARSE_ARGS = ("--start-method", "fork", "--local-steps", "100", "--long-factor", "5", "--links", "0", "--arms",
                    "ddp", "diloco f32", "diloco int8 + int8 pulls", "diloco sparseloco", "--seeds", "0", "1", "2")
CRASH_PUBLISHED_ARGS = ("--name", "crash_published", "--seeds", "3", "--start-method", "fork")


# Benchmark 7's group-count table: HDET's processes forked (changes no number but the wall-clock).
HDET_WORLD_ARGS = ("--start-method", "fork", "--workloads", "tabular", "shapes")


def search(name: str, methods: Sequence[str], votes: Sequence[str], *args: str) -> tuple[str, ...]:
    return ("--start-method", "fork", "--name", name, "--methods", *methods, "--hdet-votes", ",".join(votes), *args)


# Benchmark 3 in `make bench`: the package's default against DiLoCo and DDP, with equal speeds and at the published
# ones, three seeds; 150 steps and H = 15 keep its ten rounds per worker. Every method at every speed level
# (one seed) is the bench-full part `async_published_methods`; the defaults on three tasks `async_defaults`.
ASYNC_ARGS = ("--start-method", "fork", "--methods", "ddp", "diloco", "async_default", "--levels", "none", "very",
              "--seeds", "3")
ASYNC_FULL_SIZE = ("--steps", "150", "--local-steps", "15")
# Issue 42's workers of several ranks: 2 workers x 2 ranks against 4 one-rank workers and DDP over the same 4
# processes, at equal samples, in benchmark 3's set-up (bench-full).
ASYNC_2X2_ARGS = ("--name", "async_2x2", "--start-method", "fork", "--world-size", "4", "--methods", "ddp", "diloco",
                  "diloco_2ranks", "async_default", "async_default_2ranks", "--levels", "none", "very", "--seeds", "3")


# In the order of docs/benchmarks.md. The minutes of make bench's parts are those of its first start-to-finish run
# on the idle 2-core machine (2026-12-02, 79.8 min in all); bench-full's are estimates, HDET forked. search_baselines, from arm wall-clocks measured at S = 128 on 2026-12-01 while
# the machine was nearly idle (load 1-3; later runs under load 10-38 took 2.5-3x the wall for the same CPU time):
# one seed and start costs ~16 s on the tabular MLP (untuned 0.6, full grid 2.2, default HDET 2.4, trust region
# 2.5, grid 3.0, TPE 3.8, Prodigy and schedule-free 0.9 each), ~34 s on shapes (untuned 1.9, full grid 7.8, HDET
# 4.4, trust region 6.3, the rest ~13) and ~180 s on the char LM (untuned 12.9, full grid 64.6, HDET 18.6, trust
# region 15.4, the rest ~68): 9 seed-starts, ~34 min, plus 9 Ray PBT arms: with reused actors 56 s on tabular
# (Ray's start-up 6 s of it) and 49 s on shapes at load 2-8 (without, at load 7-15: 339 s and 254 s), the char
# LM's ~70 s estimated: ~9 min, ~43 min in all; without the trust-region arm (2026-12-02)
# ~39 min. crash: its first seed took 460 CPU-s
# (measured with getrusage under load 20-30; most of it the char LM's 300-step runs), all its runs on 4 processes
# (~1.6 CPU-s per wall-second on 2 idle cores): 3 seeds ~15 min.
PARTS = (
    Part("hdet_published", "hdet_published.py", minutes=6, full=True),  # the paper's set-up (benchmark 1): bench-full
    Part("search_baselines", "search_baselines.py", search("search_baselines", SEARCH_METHODS, SEARCH_VOTES,
                                                           "--full-grid", "--pbt-seeds", "1"),
         minutes=34, full_size=SEARCH_FULL_SIZE),
    Part("search_remedies", "search_baselines.py", search("search_remedies", REMEDY_METHODS, REMEDY_VOTES,
                                                          "--seeds", "6"),
         # (search_pb2, the four baselines and six HDET arms over six seeds, took 38 min: four arms, ~32)
         minutes=32, full_size=SEARCH_FULL_SIZE, full=True),
    Part("search_schedule_free", "search_baselines.py",
         search("search_schedule_free", SF_METHODS, SF_VOTES, "--optimizer", "schedulefree", "--seeds", "6"),
         minutes=120, full_size=SEARCH_FULL_SIZE, full=True),
    # Issue 41's longer runs: benchmark 2's char LM at 1,024 steps (the default's search ends at step 300, a vote
    # every 100), untuned and default HDET from every start, the 4x-compute grid from the 10x starts (the target's
    # reference). Idle, one 1,024-step run took 84 s (untuned) and 95 s (HDET) on 2026-12-03: ~28 min, the grid ~36.
    Part("search_long", "search_baselines.py",
         search("search_long", ("untuned",), ("defaults",), "--workloads", "char_lm", "--full-grid", "10x high",
                "10x low"),
         minutes=65, full_size=("--steps", "1024", "--pbt-interval", "128", "--val-every", "128"), full=True),
    Part("search_repeat_adamw_constant", "search_baselines.py", repeat("adamw", "constant"), minutes=33, full=True),
    Part("search_repeat_sgd_constant", "search_baselines.py", repeat("sgd", "constant"), minutes=30, full=True),
    Part("search_repeat_adamw_cosine", "search_baselines.py", repeat("adamw", "cosine"), minutes=33, full=True),
    Part("search_repeat_sgd_cosine", "search_baselines.py", repeat("sgd", "cosine"), minutes=30, full=True),
    Part("search_repeat_baselines", "search_baselines.py", repeat_baselines(), minutes=46, full=True,
         code=("benchmarks/search_pbt.py",)),
    # at 8 processes, one part per workload: measured at load 12-21 from other jobs (2026-12-06)
    *(Part(f"search_repeat_{opt}_constant_{w}_w8", "search_baselines.py", repeat_w8(opt, w), minutes=minutes,
           full=True)
      for opt, w, minutes in (("sgd", "tabular_small", 7), ("adamw", "shapes_small", 22), ("sgd", "shapes_small", 12),
                              ("adamw", "tabular_small", 7))),
    Part("async_published", "async_published.py", ASYNC_ARGS, minutes=13, full_size=ASYNC_FULL_SIZE),
    Part("async_published_methods", "async_published.py", ("--name", "async_published_methods"), minutes=30,
         full=True),
    Part("async_long_horizon", "async_published.py", ("--long-horizon",), minutes=27, full=True),
    Part("async_2x2", "async_published.py", ASYNC_2X2_ARGS, minutes=22, full_size=ASYNC_FULL_SIZE, full=True),
    Part("async_defaults", "async_defaults.py", ("--start-method", "fork"), minutes=13, full=True),
    # issue 60: Trainer(strategy="diloco") and strategy="async_local_sgd" as typed against DDP, and with the lookahead
    # outer lr; scored on validation batches the lookahead does not read
    Part("async_typed", "async_published.py", ("--name", "async_typed", "--start-method", "fork", "--world-size", "4",
                                               "--levels", "none", "--seeds", "3", "--held-out", "--methods", "ddp",
                                               "diloco_typed", "diloco_lookahead", "async_typed", "async_lookahead",
                                               "diloco", "async_default"), minutes=9, full=True),
    # bench-full since benchmark 2 at HDET's defaults took 53 min (2026-12-03): make bench would need 94 min
    Part("bad_worker", "bad_worker.py", ("--levels", "none", "very"), minutes=9, full=True),
    Part("overhead", "overhead.py", minutes=12, code=("benchmarks/sharded_fit.py",)),
    # rank 0's host memory (issue 29) on models past one 25 MiB fragment, as docs/async.md quotes it
    Part("overhead_memory", "overhead.py", ("--parts", "memory", "--memory-d-models", "768", "1280", "--exchange-steps",
                                            "20", "--local-steps", "10", "--batch-size", "4"), minutes=12, full=True),
    Part("crash", "crash.py", CRASH_ARGS, minutes=18),
    Part("crash_published", "crash.py", CRASH_PUBLISHED_ARGS, minutes=30, full=True),
    # issue 61: OuterService async and torchft DiLoCo, each with a kill and a join, and the single job: 8 arms, 6.9 min
    # at load 5-15 from other jobs (2026-12-06)
    Part("elastic", "elastic.py", minutes=6, code=("tests/scripts/elastic_run.py",)),
    # issue 61's CPU target at realistic H: torchft's CPU per inner step against the single job's, interleaved, 5
    # repetitions at H = 16 and 50 (20 runs of 400 steps per job; the single job's ranks forked: under load 20-35 its
    # four interpreters took 3-4 min to start); 27.9 min at load 6.5-30 (2026-12-07)
    Part("elastic_cpu", "elastic.py", ("--cpu-ab", "5", "--cpu-h", "16", "50", "--budget", "1600",
                                       "--single-start-method", "fork"), minutes=28,
         code=("tests/scripts/elastic_run.py",), full=True),
    # the peer (issue 60): torchft's DiLoCo beside ours, same workload and settings; ~1.5 min on the idle machine
    Part("torchft_peer", "torchft_peer.py", minutes=3),
    # bytes to a loss (issue 43): DDP, DiLoCo and async with each push codec, on loopback and behind a 100 Mbit/s
    # SlowLink; estimated from its quick run (11 fits of 4 processes; the char LM's 300 steps ~1.5 min each)
    Part("comm_bytes", "comm_bytes.py", ("--start-method", "fork"), minutes=30, full=True),
    # overlap against the blocking exchange (issue 43's second target) at two processes, one core each: at four on
    # two cores the run is CPU-bound and hiding the link cannot shorten it (research log 2026-12-04); 59 s for two arms
    # on the quiet machine, three arms ~1.5 min
    Part("comm_overlap", "comm_bytes.py", COMM_OVERLAP_ARGS, minutes=2, full=True),
    # bytes to DiLoCo's loss with SparseLoCo (issue 43's 1,000x): the char LM and the tabular MLP, measured on
    # 2026-12-05 at load 6-15 from other jobs: 16.9 min (17.9 CPU-min; int8 both ways and SparseLoCo ~2 min a seed
    # each) and 1.8 min (2.0 CPU-min)
    Part("comm_sparse", "comm_bytes.py", ("--name", "comm_sparse", *COMM_SPARSE_ARGS), minutes=17, full=True),
    Part("comm_sparse_tabular", "comm_bytes.py", ("--name", "comm_sparse_tabular", "--workload", "tabular",
                                                   *COMM_SPARSE_ARGS), minutes=2, full=True),
    # Benchmark 7 (issue 39): the default's groups at W = 4, 8, 16 (bench) and the votes the search needs (bench-full).
    # (minutes: 35 and 14 measured on 2026-12-02 under load 10-15 from other jobs; about half that on idle cores)
    # bench-full: at 35 min it took make bench past its 90 (116 min estimated with it)
    Part("hdet_world", "hdet_world.py", HDET_WORLD_ARGS, minutes=35, full=True),
    Part("hdet_votes", "hdet_votes.py", ("--start-method", "fork", "--seeds", "4"), minutes=14, full=True),
    # the outer step over 200 rounds per worker (issue 42): one process, 4.0 min (2.5 CPU-min) at load ~4, 2026-12-02
    Part("outer_stability", "outer_stability.py", minutes=4, full=True),
    # issue 60's sweep of the outer lr, momentum, schedule and H on four workloads (one process; estimated from
    # single runs at load ~3, 2026-12-06: ~75 s per setting, 16 settings)
    Part("outer_sweep", "outer_sweep.py", minutes=20, full=True),
    # a bad worker on every path (issue 42): faulty ÷ fault-free at equal healthy samples, W = 3, 3 seeds, two tasks;
    # 54 short forked runs, 3.5 min (estimated from one seed's 97 s at load ~4, 2026-12-02)
    Part("bad_worker_paths", "bad_worker_paths.py", minutes=5, full=True),
)


def commands(full: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """The commands ``make bench`` (``full=False``) or ``make bench-full`` runs, as the stamps record them."""
    return [shlex.join(p.command(extra)) for p in PARTS if full or not p.full]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also the research tables (make bench-full)")
    p.add_argument("--parts", nargs="+", default=None, metavar="NAME", help="only these parts (see --list)")
    p.add_argument("--force", action="store_true", help="run the chosen parts even when their cache is fresh")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the estimate, run nothing")
    p.add_argument("--list", action="store_true", help="print every part and its command, run nothing")
    p.add_argument("--cache-dir", type=Path, default=None, help="the records (default RESULTS_DIR/cache)")
    # Also every script's: read here to know where the parts write, and passed on when given.
    p.add_argument("--results-dir", type=Path, default=None, help="default benchmarks/results")
    p.add_argument("--docs-dir", type=Path, default=None, help="default docs")
    args, extra = p.parse_known_args(argv)
    for flag, value in (("--results-dir", args.results_dir), ("--docs-dir", args.docs_dir)):
        extra += [flag, str(value)] if value is not None else []
    return args, extra


def chosen(args: argparse.Namespace, parts: Sequence[Part]) -> list[Part]:
    if args.parts is None:
        return [p for p in parts if args.full or not p.full]
    names = [p.name for p in parts]
    unknown = [n for n in args.parts if n not in names]
    if unknown:
        raise SystemExit(f"--parts: {unknown} are not parts; the parts are {names}")
    return [p for p in parts if p.name in args.parts]


def record_path(args: argparse.Namespace, part: Part, extra: Sequence[str]) -> Path:
    return args.cache_dir / f"{part.name}{'_quick' if '--quick' in extra else ''}.json"


def plan(args: argparse.Namespace, parts: Sequence[Part], extra: Sequence[str], repo: Path) -> list[tuple]:
    """Each part with its key inputs, record and why it must run (``None``: cached); the estimate printed."""
    rows, minutes = [], 0.0
    quick = "--quick" in extra
    for part in parts:
        inputs = key_inputs(part.command(extra), [Path("benchmarks") / part.script, *map(Path, part.code)], repo)
        record = read_record(record_path(args, part, extra))
        reason = "--force" if args.force else stale_reason(record, inputs, args.docs_dir, repo)
        est = record["wall_s"] / 60 if record else (None if quick else part.minutes)
        if reason is None:
            print(f"  {part.name:<22} cached: ran {record['finished']}, {record['wall_s'] / 60:.1f} min", flush=True)
        else:
            minutes += est or 0.0
            print(f"  {part.name:<22} to run ({reason}): ~{'?' if est is None else f'{est:.0f}'} min", flush=True)
        rows.append((part, inputs, reason))
    todo = sum(r is not None for _, _, r in rows)
    print(f"{todo} of {len(rows)} parts to run, estimated {minutes:.0f} min on a 2-core machine"
          + (" (quick mode: estimates only from earlier quick runs)" if quick else ""), flush=True)
    return rows


def run_part(part: Part, inputs: dict, args: argparse.Namespace, extra: Sequence[str], repo: Path) -> int:
    """Run one part; on success write its record (key, inputs, what it wrote, its time)."""
    dirs = [args.results_dir, args.docs_dir]
    before = snapshot(dirs)
    start, cpu_before = time.perf_counter(), _children_cpu_s()
    cmd = [sys.executable, str(repo / "benchmarks" / part.script), *part.command(extra)[2:]]
    rc = subprocess.call(cmd, cwd=repo)
    wall_s, cpu_s = time.perf_counter() - start, _children_cpu_s() - cpu_before
    print(f"{part.name}: exit {rc} after {wall_s / 60:.1f} min ({cpu_s / 60:.1f} CPU-min)", flush=True)
    if rc == 0:
        written = [f for f, mtime in snapshot(dirs).items() if before.get(f) != mtime]
        write_record(record_path(args, part, extra), {
            "part": part.name, "key": key_of(inputs), "inputs": inputs, "command": shlex.join(part.command(extra)),
            "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": wall_s, "cpu_s": cpu_s,
            "outputs": outputs_of(written, args.docs_dir, repo),
        })
    return rc


def _children_cpu_s() -> float:
    """CPU seconds used by this process's finished children (a part's processes). Beside the wall-clock it tells a
    run on a loaded machine (same CPU time, longer wall) from a part that grew (both longer)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main(argv: Sequence[str] | None = None, parts: Sequence[Part] = PARTS, repo: Path = REPO) -> int:
    args, extra = parse_args(argv)
    args.results_dir = args.results_dir or repo / "benchmarks" / "results"
    args.docs_dir = args.docs_dir or repo / "docs"
    args.cache_dir = args.cache_dir or args.results_dir / "cache"
    selected = chosen(args, parts)
    if args.list:
        for part in parts:
            print(f"{part.name:<22} {'bench-full' if part.full else 'bench':<10} ~{part.minutes:>4.0f} min  "
                  f"{shlex.join(part.command())}")
        return 0
    print(f"{'make bench-full' if args.full else 'make bench'}: {len(selected)} parts", flush=True)
    rows = plan(args, selected, extra, repo)
    if args.dry_run:
        return 0
    start = time.perf_counter()
    for part, inputs, reason in rows:
        if reason is not None and (rc := run_part(part, inputs, args, extra, repo)):
            print(f"stopped at {part.name} (exit {rc}); run again to resume: finished parts stay cached")
            return rc
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
