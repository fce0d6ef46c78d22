"""Figures of what an HDET or async run did, drawn from a :class:`~lightning_hdet.records.history.History`.

Plotting needs the ``plots`` extra (matplotlib, ``pip install 'lightning-hdet[plots]'``); figures are built
without pyplot (no global state, no GUI backend) and can be saved as PNGs or logged to W&B as images.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_hdet.records.history import (
    MEAN_LR,
    GROUP_LOSS,
    GROUP_LR,
    VOTE_WEIGHT,
    WORKER_KEY,
    History,
    rescues,
    votes,
    worker_rounds,
)

if TYPE_CHECKING:
    from lightning.pytorch.loggers import Logger
    from matplotlib.figure import Figure

#: File names (without ``.png``) of the figures, in the order they are written.
FIGURE_NAMES = ("hdet_loss", "hdet_lr", "hdet_vote_weights", "async_timeline", "async_staleness")


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "lightning_hdet report plots need matplotlib: pip install 'lightning-hdet[plots]'"
        ) from err
    return matplotlib


def _new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    """A pyplot-free Figure (no global state, no GUI backend)."""
    _matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def member_color(index: int) -> tuple[float, float, float, float]:
    """The colour of group/worker ``index``, the same in every figure."""
    colormaps = _matplotlib().colormaps
    palette = colormaps["tab10"] if index < 10 else colormaps["tab20"]
    return palette(index % palette.N)


def _require(ok: bool, what: str, key: str) -> None:
    if not ok:
        raise ValueError(f"history has no {key!r} values; cannot plot {what}")


def _at_votes(history: History, key: str, vote_steps: Sequence[int]) -> tuple[list[int], list[float]]:
    """``key``'s series, restricted to the vote steps when there are votes (drops re-emitted values)."""
    steps, values = history.series(key)
    if not vote_steps:
        return steps, values
    keep = set(vote_steps)
    points = [(s, v) for s, v in zip(steps, values) if s in keep]
    return [s for s, _ in points], [v for _, v in points]


def plot_group_losses(history: History) -> Figure:
    """Each group's interval-mean loss, with every vote as a vertical line labelled by its winner
    (every winner when there are at most 20 votes, otherwise where the winner changes)."""
    groups = history.indices(GROUP_LOSS)
    _require(bool(groups), "group losses", "hdet/group{g}/loss")
    vote_steps, winners = votes(history)
    fig = _new_figure()
    ax = fig.add_subplot()
    for g in groups:
        steps, losses = _at_votes(history, f"hdet/group{g}/loss", vote_steps)
        ax.plot(steps, losses, marker="o", markersize=3, color=member_color(g), label=f"group {g}")
    if vote_steps:
        ax.vlines(vote_steps, 0, 1, transform=ax.get_xaxis_transform(), colors="0.6", linestyles=":",
                  linewidth=1, gid="votes", label="vote")
        every = len(vote_steps) <= 20
        for i, (step, winner) in enumerate(zip(vote_steps, winners)):
            if every or i == 0 or winner != winners[i - 1]:
                ax.annotate(f"g{winner}", (step, 1.0), xycoords=ax.get_xaxis_transform(), ha="center",
                            va="bottom", fontsize=8, fontweight="bold", color=member_color(winner))
    rescue_steps = rescues(history)
    if rescue_steps:
        ax.scatter(rescue_steps, [0.0] * len(rescue_steps), transform=ax.get_xaxis_transform(), marker="^",
                   s=60, color="black", zorder=3, clip_on=False, label="rescue", gid="rescues")
    ax.set_title("Loss per group (interval mean) — votes marked with their winner", pad=14)
    ax.set_xlabel("global step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, ncols=2)
    return fig


def plot_group_lrs(history: History) -> Figure:
    """Each group's learning rate over time on a log scale, with the groups' mean LR dashed."""
    groups = history.indices(GROUP_LR)
    _require(bool(groups), "group learning rates", "hdet/group{g}/lr")
    fig = _new_figure()
    ax = fig.add_subplot()
    for g in groups:
        steps, lrs = history.series(f"hdet/group{g}/lr")
        ax.plot(steps, lrs, color=member_color(g), linewidth=1.5, label=f"group {g}", drawstyle="steps-post")
    steps, base = history.series(MEAN_LR)
    if steps:
        ax.plot(steps, base, color="black", linestyle="--", linewidth=1, label="mean LR", gid="mean_lr",
                drawstyle="steps-post")
    vote_steps, _ = votes(history)
    if vote_steps:
        ax.vlines(vote_steps, 0, 1, transform=ax.get_xaxis_transform(), colors="0.75", linestyles=":",
                  linewidth=1, gid="votes")
    ax.set_yscale("log")
    ax.set_title("Learning rate per group")
    ax.set_xlabel("global step")
    ax.set_ylabel("learning rate (log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=8, ncols=2)
    return fig


def plot_vote_weights(history: History) -> Figure:
    """Vote weights as a groups × votes heatmap; the winner of each vote is outlined."""
    groups = history.indices(VOTE_WEIGHT)
    _require(bool(groups), "vote weights", "hdet/vote/weight{g}")
    vote_steps, winner_list = votes(history)
    if not vote_steps:
        vote_steps = sorted({s for g in groups for s in history.series(f"hdet/vote/weight{g}")[0]})
    matrix = [[history.rows[s].get(f"hdet/vote/weight{g}", math.nan) for s in vote_steps] for g in groups]
    fig = _new_figure(width=max(6.0, 1.0 + 0.45 * len(vote_steps)), height=1.6 + 0.45 * len(groups))
    ax = fig.add_subplot()
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="vote weight")
    winners = dict(zip(vote_steps, winner_list))
    from matplotlib.patches import Rectangle

    for col, step in enumerate(vote_steps):
        if step in winners and winners[step] in groups:
            row = groups.index(winners[step])
            ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="white", linewidth=2))
    tick_every = max(1, len(vote_steps) // 12)
    ax.set_xticks(range(0, len(vote_steps), tick_every), [str(s) for s in vote_steps[::tick_every]])
    ax.set_yticks(range(len(groups)), [f"group {g}" for g in groups])
    for label, g in zip(ax.get_yticklabels(), groups):
        label.set_color(member_color(g))
    ax.set_title("Vote weights (winner outlined)")
    ax.set_xlabel("vote at global step")
    return fig


def plot_worker_timeline(history: History) -> Figure:
    """Per-worker timeline of the logged rounds: computing (solid) then waiting for the exchange
    (hatched), laid end to end on a reconstructed wall-clock axis."""
    workers = [w for w in history.indices(WORKER_KEY) if worker_rounds(history, w)]
    _require(bool(workers), "a worker timeline", "async/worker{w}/compute_s")
    fig = _new_figure(height=1.4 + 0.6 * len(workers))
    ax = fig.add_subplot()
    for y, w in enumerate(workers):
        rounds = worker_rounds(history, w)
        starts = [0.0]
        for r in rounds[:-1]:
            starts.append(starts[-1] + r.compute_s + r.wait_s)
        ax.barh([y] * len(rounds), [r.compute_s for r in rounds], left=starts, height=0.6,
                color=member_color(w), edgecolor="white", linewidth=0.5,
                label="computing" if y == 0 else None)
        ax.barh([y] * len(rounds), [r.wait_s for r in rounds],
                left=[s + r.compute_s for s, r in zip(starts, rounds)], height=0.6, color="0.85", edgecolor="0.5", hatch="///", linewidth=0.5,
                label="waiting" if y == 0 else None)
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (logged rounds laid end to end)")
    ax.set_title("Async rounds per worker: who computed, who waited")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_staleness(history: History) -> Figure:
    """Histogram of pseudo-gradient staleness (outer updates applied in between), stacked by worker."""
    workers = history.indices(WORKER_KEY)
    values: dict[int, list[float]] = {}
    for w in workers:
        rounds = worker_rounds(history, w)
        staleness = ([r.staleness for r in rounds if r.staleness is not None] if rounds
                     else history.series(f"async/worker{w}/staleness")[1])
        if staleness:
            values[w] = staleness
    _require(bool(values), "staleness", "async/worker{w}/staleness")
    top = int(max(max(v) for v in values.values()))
    fig = _new_figure(width=6.5)
    ax = fig.add_subplot()
    ax.hist(list(values.values()), bins=[b - 0.5 for b in range(top + 2)], stacked=True,
            color=[member_color(w) for w in values], label=[f"worker {w}" for w in values],
            edgecolor="white", linewidth=0.5)
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness (outer updates since the worker pulled)")
    ax.set_ylabel("rounds")
    ax.set_title("Staleness of pushed updates")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return fig


def make_figures(history: History) -> dict[str, Figure]:
    """Every figure the history has data for, keyed by a name from :data:`FIGURE_NAMES`."""
    keys = history.keys
    worker_fields = {m.group(2) for k in keys if (m := WORKER_KEY.match(k))}
    builders = {
        "hdet_loss": (plot_group_losses, any(GROUP_LOSS.match(k) for k in keys)),
        "hdet_lr": (plot_group_lrs, any(GROUP_LR.match(k) for k in keys)),
        "hdet_vote_weights": (plot_vote_weights, any(VOTE_WEIGHT.match(k) for k in keys)),
        "async_timeline": (plot_worker_timeline, "compute_s" in worker_fields),
        "async_staleness": (plot_staleness, "staleness" in worker_fields),
    }
    return {name: build(history) for name, (build, present) in builders.items() if present}


def save_figures(figures: Mapping[str, Figure], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write each figure as ``<out_dir>/<name>.png``; returns the paths in order."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _png_bytes(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def log_figures_to_wandb(logger: Logger | Iterable[Logger], figures: Mapping[str, Figure],
                         step: int | None = None) -> int:
    """Log ``figures`` as images under ``plots/<name>`` to every ``WandbLogger`` among ``logger``.

    Accepts one logger or ``trainer.loggers``; other loggers are skipped. Safe on every rank (only
    rank 0 writes). Returns how many W&B loggers received the figures.
    """
    from lightning.pytorch.loggers import WandbLogger

    loggers = [logger] if not isinstance(logger, Iterable) else list(logger)
    targets = [lg for lg in loggers if isinstance(lg, WandbLogger)]
    if not targets or not figures:
        return 0
    from PIL import Image

    for name, fig in figures.items():
        image = Image.open(io.BytesIO(_png_bytes(fig)))
        for target in targets:
            target.log_image(key=f"plots/{name}", images=[image], step=step)
    return len(targets)


def log_report_figures(trainer: Any, history: History) -> int:
    """At the end of fit (rank 0): log the run's figures to every ``WandbLogger`` of ``trainer``, if any and if
    matplotlib (the ``plots`` extra) is installed. Returns how many W&B loggers received them."""
    if not any(type(lg).__name__ == "WandbLogger" for lg in trainer.loggers):
        return 0
    try:
        figures = make_figures(history)
    except ImportError:
        return 0
    return log_figures_to_wandb(trainer.loggers, figures, step=trainer.global_step)
