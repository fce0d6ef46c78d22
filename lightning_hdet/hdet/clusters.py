"""Clusters: neighbouring groups that train as one data-parallel job under ``gradient_sync="cluster"`` (pure).

A cluster is a run of neighbouring groups at the same learning rates (and other explored values) that hold the same
model and optimizer state. Its ranks average one gradient, so the incumbent LR of the search trains on their whole
share of the batch instead of as several smaller runs of the same experiment (issue 41, docs/hdet.md). A cluster
only stays together while its members stay identical: a vote that gives its members different rows, different merge
strengths or a restart for some of them splits it; where every group takes one model (a roll-back, the search's
end) the runs of equal rows join again.

Clusters are lists of group indices, in order, covering every group once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from lightning_hdet._checks import require

Clusters = list[list[int]]


def singletons(num_groups: int) -> Clusters:
    """Every group alone (``gradient_sync="group"``)."""
    return [[g] for g in range(num_groups)]


def equal_runs(rows: Tensor) -> Clusters:
    """The runs of neighbouring groups whose rows are equal (``rows``: one row per group, e.g. the multiplier table
    beside the explored hyperparameters' tables)."""
    clusters: Clusters = [[0]]
    for g in range(1, rows.shape[0]):
        if bool((rows[g] == rows[g - 1]).all()):
            clusters[-1].append(g)
        else:
            clusters.append([g])
    return clusters


def split_where(clusters: Clusters, keys: Sequence[object]) -> Clusters:
    """``clusters`` with each cut between neighbouring members whose ``keys`` (one per group) differ."""
    out: Clusters = []
    for cluster in clusters:
        out.append([cluster[0]])
        for prev, g in zip(cluster, cluster[1:]):
            if keys[g] == keys[prev]:
                out[-1].append(g)
            else:
                out.append([g])
    return out


def next_clusters(clusters: Clusters, rows: Tensor, treatment: Sequence[object], common: Sequence[object] = ()) -> Clusters:
    """The clusters after one vote.

    Args:
        clusters: the clusters before it.
        rows: every group's new rows (multipliers and explored values).
        treatment: what the vote did to each group's parameters and optimizer state, one comparable value per group
            (e.g. its merge strengths and whether it restarts): members treated differently no longer hold one model.
        common: where every group took one state (a roll-back, the search's end), what each group took (e.g.
            whether from the initial model): the runs of equal rows and equal ``common`` form the clusters. Empty:
            no common state, so clusters can only split.
    """
    if common:
        return split_where(equal_runs(rows), list(common))
    kept = split_where(clusters, list(treatment))
    return [part for cluster in kept for part in split_where([cluster], _row_keys(rows, cluster))]


def after_vote(clusters: Clusters, rows: Tensor, decision: Any) -> Clusters:
    """The clusters after a vote's ``decision`` (a :class:`~lightning_hdet.hdet.rules.controller.Decision`) was
    carried out, ``rows`` the groups' new rates: at a roll-back every group took the restore point (or the initial
    model, ``from_initial``); otherwise each group's merge strengths and optimizer restart say how it was treated."""
    groups = rows.shape[0]
    if decision.roll_back:
        return next_clusters(clusters, rows, [], list(decision.from_initial) or [False] * groups)
    plan, restart = decision.plan, decision.restart
    treatment = [(tuple(float(step.strengths[g]) for step in plan), bool(restart[g])) for g in range(groups)]
    return next_clusters(clusters, rows, treatment)


def _row_keys(rows: Tensor, cluster: list[int]) -> list[object]:
    keys: list[object] = [None] * rows.shape[0]
    for g in cluster:
        keys[g] = tuple(rows[g].tolist())
    return keys


def check_clusters(clusters: Clusters, num_groups: int) -> None:
    """Runs of neighbouring groups, in order, covering each of ``num_groups`` groups once."""
    flat = [g for c in clusters for g in c] if isinstance(clusters, list) else None
    require("clusters", clusters, flat == list(range(num_groups)) and all(c for c in clusters),
            f"runs of neighbouring group indices covering 0..{num_groups - 1} once, in order, e.g. [[0], [1, 2], [3]]")


def cluster_of(clusters: Clusters, group: int) -> list[int]:
    """The cluster that holds ``group``."""
    return next(c for c in clusters if group in c)
