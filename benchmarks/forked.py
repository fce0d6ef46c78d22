"""Start a script as its own process forked from one interpreter that has already imported torch and Lightning.

A multi-process run on loopback (tests/scripts/elastic_run.py's workers and service, tests/scripts/torchft_job.py's
jobs) starts several Python processes; each spends ~4 s of CPU importing torch and Lightning before it does anything,
most of a short run's time. :func:`start` forks them instead from a forkserver that imported both once: each is
still a separate process, with its own ``__main__``, environment, output file, exit status and signals, running the
script as ``python script args`` would (its directory first on ``sys.path``, its ``atexit`` handlers run at the
end). What it returns offers what the runs use of ``subprocess.Popen``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback

#: Imported once, in the forkserver.
PRELOAD = ["torch", "lightning.pytorch"]
_started: list[Forked] = []


class Forked:
    """A process started by :func:`start`: ``poll``, ``wait``, ``send_signal``, ``kill``, ``pid`` and
    ``returncode`` as ``subprocess.Popen`` has them (a signal's death is ``-signum``)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]) -> None:
        self.process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:  # as Popen: never a pid that may have been reused
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _main(script: str, argv: list[str], env: dict[str, str], log: str, cwd: str | None = None,
          err: str | None = None) -> None:
    """In the forked process: output to ``log`` (stderr to ``err`` if given), the environment ``env``, the working
    directory ``cwd`` (else the forkserver's), then the script as ``__main__``; the exit status as the interpreter's
    own (threads joined and ``atexit`` handlers run first)."""
    if cwd is not None:
        os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if err is not None:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (as the interpreter: the traceback, status 1)
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter's exit does, in its order
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once per process) with torch and Lightning imported under
    ``OMP_NUM_THREADS=1`` (OpenMP reads it as it loads)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return context


def start(script: str, argv: list[str], env: dict[str, str], log: str, cwd: str | None = None,
          err: str | None = None) -> Forked:
    """Run ``python script *argv`` with environment ``env`` and its output in the file ``log``, forked; in ``cwd``
    and with stderr in the file ``err`` if given, as ``subprocess.Popen``'s ``cwd`` and ``stderr``."""
    process = _context().Process(target=_main, args=(script, argv, env, log, cwd, err), daemon=False)
    process.start()
    _started.append(Forked(process, [script, *argv]))
    return _started[-1]


def run(script: str, argv: list[str], env: dict[str, str], cwd: str,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``,
    forked (:func:`start`): its exit status, stdout and stderr (kept apart, in files under ``cwd``). Past ``timeout``
    it raises ``subprocess.TimeoutExpired``; either way nothing is left running."""
    logs = []
    for stream in ("out", "err"):
        fd, log = tempfile.mkstemp(prefix=f"{os.path.basename(script)}_", suffix=f".{stream}", dir=cwd)
        os.close(fd)
        logs.append(log)
    proc = start(script, argv, env, logs[0], cwd=cwd, err=logs[1])
    try:
        code = proc.wait(timeout)
    finally:
        proc.kill()  # a no-op once it has ended
    with open(logs[0]) as out, open(logs[1]) as err:
        return subprocess.CompletedProcess([script, *argv], code, out.read(), err.read())


@atexit.register  # after multiprocessing's own handler was registered, so before it runs: it joins every child
def _kill_left_over() -> None:
    """Kill what a run that failed half-way left running (frozen, waiting on the others), so that this process's
    exit does not wait for it."""
    for process in _started:
        process.kill()
