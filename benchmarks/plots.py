"""Bar charts of the benchmarks whose result is a few numbers per arm (overhead, elastic)."""

from __future__ import annotations

import math
from pathlib import Path


def plot_bars(path: Path, panels: dict[str, dict[str, float]], title: str) -> Path:
    """One horizontal bar chart per panel (label -> value, a missing value drawn as 0 and marked), side by side;
    saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 0.5 * max(map(len, panels.values())) + 1.4),
                             squeeze=False)
    for ax, (xlabel, bars) in zip(axes[0], panels.items()):
        labels = list(bars)
        values = [bars[k] if bars[k] is not None and math.isfinite(bars[k]) else 0.0 for k in labels]
        ax.barh(labels, values, color=["#bbb" if bars[k] is None else "C0" for k in labels])
        for y, k in enumerate(labels):
            if bars[k] is None:
                ax.text(0, y, " none", va="center")
        ax.invert_yaxis()  # the first label on top, as in the table
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="x")
    for ax in axes[0][1:]:
        ax.set_yticklabels([])
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
