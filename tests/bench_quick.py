"""Running a benchmark script at its quick settings, for the quick-mode tests of every benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_quick(tmp_path: Path, script: str, *extra: str) -> tuple[dict, list[str], subprocess.CompletedProcess]:
    """Run ``benchmarks/<script>.py --quick`` with outputs under ``tmp_path``; return its JSON, the table lines
    of its docs block and the process."""
    results, docs = tmp_path / "results", tmp_path / "docs"
    cmd = [sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--quick", *extra,
           "--results-dir", str(results), "--docs-dir", str(docs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = f"{script}_quick"
    data = json.loads((results / f"{name}.json").read_text())
    assert {"meta", "config"} <= data.keys() and data["config"]["quick"] is True
    block = (docs / "benchmarks.md").read_text().split(f"<!-- BEGIN {name} -->")[1].split(f"<!-- END {name} -->")[0]
    table = [line for line in block.splitlines() if line.startswith("|")]
    assert table and table[0] in proc.stdout
    return data, table, proc
