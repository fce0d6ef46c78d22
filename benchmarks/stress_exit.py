"""Stress test of a clean exit: run each strategy's trainer entry sequences many times, each in a fresh interpreter.

A run is one Lightning job of two CPU processes (Lightning's subprocess launcher, gloo) on Lightning's ``BoringModel``
that enters the trainer in sequence (e.g. ``fit,validate,test,fit``) and exits. The C++ runtime aborts a process
at interpreter exit ("terminate called without an active exception", SIGABRT) when a native thread of a process
group, a store or one of ours is still joinable then; this happens in some runs only, so it is counted over many.
Each run is classified by both processes' exit codes (rank 0 waits for rank 1 and reports its code):

* ``ok``: both exited 0, and no more process groups (besides the default one) were alive after the last entry
  than after the first (``"hdet_fsdp"`` keeps its device mesh's groups from one entry to the next; the others keep
  none);
* ``abort``: a process was killed by SIGABRT (exit code -6 or 134) or printed ``terminate called``;
* ``leak``: both exited 0, but later entries left more process groups alive than the first one did;
* ``hang``: the run outlived ``--timeout``; ``fail``: any other exit code.

    python benchmarks/stress_exit.py --runs 100                     # every strategy, every sequence
    python benchmarks/stress_exit.py --runs 20 --strategies diloco --sequences fit,validate

Not part of ``make test`` (``make stress`` runs it); see ``docs/failure_modes.md`` for the last counts.
A step ``error`` in a sequence is a ``fit`` whose ``training_step`` raises on every rank at its second step (the run
catches the error and goes on), to exercise the exception path.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("async_local_sgd", "diloco", "hdet", "hdet_fsdp")
SEQUENCES = ("fit,validate", "fit,validate,test,fit", "error,fit")
STEPS = ("fit", "validate", "test", "predict", "error")
_CHILD_FLAG = "--child"
_RESULT = "STRESS_EXIT_RESULT"


class _Planned(RuntimeError):
    """The ``error`` step's exception."""


def child(strategies: str, sequence: str, check: bool = False) -> None:
    """One run (both ranks execute this: the subprocess launcher starts rank 1 with the same command line): for each
    of ``strategies`` (joined by ``+``) in turn, a trainer enters ``sequence``. ``check``: then destroy the default
    group and count the native gloo threads left (none, unless something still references a destroyed group)."""
    import warnings

    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_hdet import AdaptiveSteps, AsyncLocalSGDStrategy
    from lightning_hdet.testing import live_gloo_threads, live_process_groups

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    class Model(BoringModel):
        fail = False

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if self.fail and batch_idx == 1:
                raise _Planned("planned failure")
            return super().training_step(batch, batch_idx)

    groups, threads, launchers = [], [], []  # after each entry: live groups besides the default one, gloo threads
    for strategy in strategies.split("+"):
        model = Model()
        mode = {"async_local_sgd": "async", "diloco": "sync"}.get(strategy)
        steps = AdaptiveSteps(2) if mode == "async" else 2
        chosen = AsyncLocalSGDStrategy(local_steps=steps, mode=mode) if mode else strategy  # type: ignore[arg-type]
        trainer = Trainer(strategy=chosen,
                          accelerator="cpu", devices=2, max_steps=4, limit_train_batches=4, limit_val_batches=2,
                          limit_test_batches=2, limit_predict_batches=2, num_sanity_val_steps=0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        for step in sequence.split(","):
            model.fail = step == "error"
            try:
                if step in ("fit", "error"):
                    trainer.fit(model)
                else:
                    getattr(trainer, step)(model, **({} if step == "predict" else {"verbose": False}))
            except _Planned:
                pass
            groups.append(live_process_groups())
            threads.append(_settled(live_gloo_threads))
        launchers.append(trainer.strategy.launcher)
    left = None
    if check:
        dist.destroy_process_group()
        left = live_gloo_threads()
    codes = [process.wait(timeout=120) for launcher in launchers for process in getattr(launcher, "procs", [])]
    if trainer.global_rank == 0:
        print(f"{_RESULT} groups={_join(groups)} gloo_threads={_join(threads)} left={left} others={_join(codes)}",
              flush=True)


def _join(values: list) -> str:
    return ",".join(map(str, values))


def report(output: str) -> dict[str, str] | None:
    """The result line rank 0 printed, as ``{"groups": "0,0", "gloo_threads": "3,3", "left": ..., "others": ...}``."""
    lines = [line for line in output.splitlines() if line.startswith(_RESULT)]
    return dict(item.split("=", 1) for item in lines[-1].split()[1:]) if lines else None


def classify(returncode: int | None, output: str) -> str:
    """One run's outcome from rank 0's exit code (``None``: timed out) and the run's output."""
    if returncode is None:
        return "hang"
    result = report(output)
    codes = [returncode] + [int(c) for c in (result or {}).get("others", "").split(",") if c]
    if "terminate called" in output or any(c in (-6, 134) for c in codes):
        return "abort"
    if any(codes) or result is None:
        return "fail"
    grew = [counts.split(",") for counts in (result["groups"], result["gloo_threads"])]
    return "leak" if any(int(c[-1]) > int(c[0]) for c in grew if "None" not in c) else "ok"


def _settled(read: Callable[[], Optional[int]], reads: int = 4, interval_s: float = 0.05,
             limit_s: float = 2.0) -> Optional[int]:
    """``read()`` once it gives the same count ``reads`` times in a row (at most ``limit_s``). Why: a destroyed
    group's gloo threads end asynchronously, once the last reference to it is collected; read at once, a thread
    still winding down counts as one left behind (one entry of 12 in a CI run read 4 where the others read 3)."""
    gc.collect()
    last, same, deadline = read(), 1, time.monotonic() + limit_s
    while same < reads and time.monotonic() < deadline:
        time.sleep(interval_s)
        count = read()
        same = same + 1 if count == last else 1
        last = count
    return last


def run_once(strategy: str, sequence: str, timeout: float, check: bool = False) -> tuple[str, str]:
    """One fresh interpreter running ``sequence`` on ``strategy`` (several joined by ``+``, one after the other):
    its outcome and its output (see :func:`child` for ``check``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, str(Path(__file__).resolve()), _CHILD_FLAG, strategy, sequence,
               *(["check"] if check else [])]
    # a session of its own: a run that hangs is killed with its rank-1 process (the launcher's child)
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return "hang", output
    return classify(process.returncode, output), output


def run_forked(strategy: str, sequence: str, timeout: float) -> tuple[str, str]:
    """The same run with both processes forked from this one, which has imported torch and Lightning already (ten
    times cheaper than two fresh interpreters, whose start-up is most of a run). Each process sets the variables a
    launcher would, runs :func:`child` and then exits through the interpreter's normal shutdown (``sys.exit``: exit
    handlers, module teardown, the C++ runtime's destructors), where the abort happens."""
    port, pids, logs = _free_port(), [], []
    for rank in (0, 1):
        log = tempfile.TemporaryFile("w+")
        logs.append(log)
        pid = os.fork()
        if pid == 0:  # the run's process (never returns)
            os.setpgid(0, 0)
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0",
                              WORLD_SIZE="2")
            code = 0
            try:
                child(strategy, sequence)
            except BaseException:  # reported in the output; the run fails
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.exit(code)
        pids.append(pid)
    deadline, codes = time.monotonic() + timeout, [None, None]
    while None in codes and time.monotonic() < deadline:
        for k, pid in enumerate(pids):
            if codes[k] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[k] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for k, pid in enumerate(pids):
        if codes[k] is None:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    output = ""
    for log in logs:
        log.seek(0)
        output += log.read()
        log.close()
    if None in codes:
        return "hang", output
    return classify(codes[0], output.replace("others=", f"others={codes[1]}", 1)), output


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs per strategy and sequence")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--sequences", nargs="+", default=list(SEQUENCES),
                        help=f"comma-separated trainer entries, each one of {', '.join(STEPS)}")
    parser.add_argument("--fresh", action="store_true",
                        help="two fresh interpreters per run under Lightning's subprocess launcher (default: both "
                             "forked from this process, see run_forked)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take")
    parser.add_argument("--keep", type=Path, default=None, help="folder for the output of every run not ok")
    args = parser.parse_args(argv)
    for sequence in args.sequences:
        bad = [s for s in sequence.split(",") if s not in STEPS]
        if bad:
            parser.error(f"--sequences {sequence!r}: unknown step(s) {bad}; allowed: {', '.join(STEPS)}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if not args.fresh:
        _warm_up()
    cells = [(s, q) for s in args.strategies for q in args.sequences]
    print(f"stress_exit: {args.runs} {'fresh' if args.fresh else 'forked'} run(s) per cell, {len(cells)} cell(s), "
          f"commit {commit()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()} ({os.cpu_count()} CPUs), "
          f"python {platform.python_version()}", flush=True)
    print("| strategy | sequence | runs | ok | abort | leak | hang | fail | s/run |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for strategy, sequence in cells:
        start = time.monotonic()
        run = run_once if args.fresh else run_forked
        results = [run(strategy, sequence, args.timeout) for _ in range(args.runs)]
        counts = Counter(outcome for outcome, _ in results)
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for i, (outcome, output) in enumerate(results):
                if outcome != "ok":
                    (args.keep / f"{strategy}_{sequence.replace(',', '-')}_{i}_{outcome}.log").write_text(output)
        seconds = (time.monotonic() - start) / args.runs
        print(f"| {strategy} | {sequence} | {args.runs} | " + " | ".join(str(counts[k]) for k in
              ("ok", "abort", "leak", "hang", "fail")) + f" | {seconds:.1f} |", flush=True)


def _warm_up() -> None:
    """Import what a run needs, once, before forking (the forked processes find it imported)."""
    import warnings

    import lightning.pytorch  # noqa: F401
    from lightning.pytorch.demos import boring_classes  # noqa: F401

    import lightning_hdet  # noqa: F401

    warnings.filterwarnings("ignore")
    if threading.active_count() > 1:  # a process with threads must not fork
        raise RuntimeError(f"stress_exit: {threading.active_count()} threads before forking; run with --fresh")


if __name__ == "__main__":
    if len(sys.argv) in (4, 5) and sys.argv[1] == _CHILD_FLAG:
        child(sys.argv[2], sys.argv[3], check=sys.argv[4:] == ["check"])
    else:
        main()
