"""Run every benchmark in turn (what ``make bench`` does); extra arguments (e.g. ``--quick``) are passed on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# In the order of docs/benchmarks.md: 1 published HDET table, 2 search baselines, 3 published async table, its
# long-horizon variant and the async defaults on three tasks, 4 overhead, 5 crash (NaN- and collapse-type
# failures), 6 elastic (a worker lost mid-run). Each entry is a script and its own arguments; the command line's
# (e.g. ``--quick``) follow them.
# Benchmark 2 with every method and HDET arm of its tables in docs/benchmarks.md (every remedy of issue 13), its
# HDET processes forked as the tables' were (saves ~10 s of imports per HDET run; changes no number but the
# wall-clock).
SEARCH = ["--start-method", "fork", "--full-grid",
          "--methods", "untuned", "grid", "optuna_tpe", "pbt", "pbt_minimal", "prodigy", "schedulefree",
          "--hdet-votes", "softmax,pbt,pbt:heldout,softmax:heldout,pbt@global,softmax@global,pbt:heldout@global,"
          "trust_region@global,"
          "pbt>pbt@global,pbt+search,pbt@global+search,pbt+ref,pb2,pb2+search,pb2@global,"
          "pbt:improvement,softmax:improvement,pbt:forecast,softmax:forecast"]
# Benchmark 2 again with schedule-free AdamW as the optimizer whose LR every search (grid, TPE, PBT, HDET) tunes:
# its own table in docs/benchmarks.md (search_schedule_free).
SEARCH_SF = ["--start-method", "fork", "--optimizer", "schedulefree", "--name", "search_schedule_free",
             "--methods", "grid", "optuna_tpe", "pbt", "prodigy", "schedulefree",
             "--hdet-votes", "softmax,pbt,pbt@global,pbt+search,pb2+search"]
# Arguments a script takes only at full size: they would override ``--quick``'s sizes.
FULL_SIZE = {"search_baselines.py": ["--steps", "128", "--pbt-interval", "32", "--val-every", "16"]}
SCRIPTS = [["hdet_published.py"], ["search_baselines.py", *SEARCH], ["search_baselines.py", *SEARCH_SF],
           ["async_published.py"],
           ["async_published.py", "--long-horizon"], ["async_defaults.py"], ["overhead.py"], ["crash.py", "--full-grid", "--default-votes", "pbt,trust_region"],
           ["elastic.py"]]


def main() -> int:
    for script, *args in SCRIPTS:
        if "--quick" not in sys.argv[1:]:
            args = [*args, *FULL_SIZE.get(script, [])]
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / script), *args, *sys.argv[1:]])
        print(f"{' '.join([script, *args])}: exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
