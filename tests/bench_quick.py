"""Running a benchmark script at its quick settings, for the quick-mode tests of every benchmark."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks import forked

REPO = Path(__file__).resolve().parents[1]


def run_script(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    """``python benchmarks/<script>.py *args`` in ``tmp_path`` with this process's environment, run to its end: its
    exit status, stdout and stderr. Forked from an interpreter that imported torch and Lightning once
    (benchmarks/forked.py; the script still runs as its own process, as ``__main__``): those imports, ~4 s of CPU
    in each of the ~16 scripts these tests start, were a large part of the suite's time on 2 cores."""
    return forked.run(str(REPO / "benchmarks" / f"{script}.py"), list(args), dict(os.environ), str(tmp_path))


def run_quick(tmp_path: Path, script: str, *extra: str) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    """Run ``benchmarks/<script>.py --quick`` with outputs under ``tmp_path``; return its JSON, the table lines
    of its docs block and the process."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    proc = run_script(tmp_path, script, "--quick", *extra, "--results-dir", str(results), "--docs-dir", str(docs))
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = f"{script}_quick"
    data = json.loads((results / f"{name}.json").read_text())
    assert {"meta", "config"} <= data.keys() and data["config"]["quick"] is True
    block = (docs / "benchmarks.md").read_text().split(f"<!-- BEGIN {name} -->")[1].split(f"<!-- END {name} -->")[0]
    table = [line for line in block.splitlines() if line.startswith("|")]
    assert table and table[0] in proc.stdout
    return data, table, proc
