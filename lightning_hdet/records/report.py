"""The report: ``python -m lightning_hdet.report RUN [--out DIR]`` (console script ``lightning-hdet-report``).

Reads a ``CSVLogger`` or ``TensorBoardLogger`` directory (the ``vote_history.csv`` beside either fills in the
votes), a ``vote_history.csv`` alone, or a W&B offline run directory, and writes PNGs: per-group loss curves with the
votes marked, per-group learning rates, vote weights as a heatmap, and for async runs a per-worker timeline of
rounds and a staleness histogram.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from lightning_hdet.records.figures import make_figures, save_figures
from lightning_hdet.records.history import load_history

def write_report(run: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Load ``run``, draw every figure it has data for and save them as PNGs (default ``<run>/report``)."""
    history = load_history(run)
    figures = make_figures(history)
    if not figures:
        raise ValueError(
            f"run={str(run)!r} has none of the hdet/... or async/... keys this report plots; "
            "was the HDET callback or the async strategy active?"
        )
    if out_dir is None:
        run_path = Path(run)
        out_dir = (run_path if run_path.is_dir() else run_path.parent) / "report"
    return save_figures(figures, out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-hdet-report``: write the PNGs and print their paths."""
    parser = argparse.ArgumentParser(
        prog="lightning-hdet-report",
        description="Plot an HDET / async run from its CSVLogger or TensorBoardLogger directory, its vote_history.csv "
                    "or its W&B (offline) run directory.",
    )
    parser.add_argument("run", help="CSVLogger / TensorBoardLogger log dir, its metrics.csv or events.out.tfevents.* "
                        "file, a vote_history.csv; W&B run dir or its run-*.wandb")
    parser.add_argument("--out", default=None, help="output directory (default: <run>/report)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run, args.out)
    except ValueError as err:
        parser.error(str(err))
    for path in paths:
        print(path)
    return 0
