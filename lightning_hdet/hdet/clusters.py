"""Clusters: groups that train as one data-parallel job under ``gradient_sync="cluster"`` (pure).

A cluster is a set of groups at the same learning rates (and other explored values) that hold the same model and
optimizer state. Its ranks average one gradient, so the incumbent LR of the search trains on their whole share of
the batch instead of as several smaller runs of the same experiment (issue 41, docs/hdet.md). A cluster stays
together only while its members stay identical: a vote that gives its members different rows, different merge
strengths or a restart for some of them splits it. Groups join where they come to hold one state: every group at a
roll-back (the restore point) or at the search's end, and a group that copied another whole and took its rates
(``experimental.Halving``) joins that group's cluster.

Clusters are sorted lists of group indices, ordered by their first, covering every group once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_hdet._checks import require

Clusters = list[list[int]]


def singletons(num_groups: int) -> Clusters:
    """Every group alone (``gradient_sync="group"``)."""
    return [[g] for g in range(num_groups)]


def for_sync(gradient_sync: str, num_groups: int, clusters: Clusters) -> Clusters:
    """The groups that average one gradient under ``gradient_sync``: all together (``"global"``), each alone
    (``"group"``), or (a copy of) ``clusters`` (``"cluster"``)."""
    if gradient_sync == "global":
        return [list(range(num_groups))]
    if gradient_sync == "group":
        return singletons(num_groups)
    return [list(c) for c in clusters]


def stacked_rows(tables: Sequence[Tensor], num_groups: int) -> Tensor:
    """Every group's rates as one row: its multipliers beside its explored hyperparameters' values (``tables``:
    the multiplier table, then each explored table, one row per group); groups with equal rows train alike."""
    return torch.cat([t.reshape(num_groups, -1).double() for t in tables], dim=1)


def by_key(groups: Sequence[int], keys: Sequence[Hashable]) -> Clusters:
    """``groups`` split by their ``keys`` (one per group index), in order of first appearance."""
    parts: dict[Hashable, list[int]] = {}
    for g in groups:
        parts.setdefault(keys[g], []).append(g)
    return list(parts.values())


def row_keys(rows: Tensor) -> list[tuple[float, ...]]:
    """Each group's row (multipliers beside explored values) as a hashable key."""
    return [tuple(r) for r in rows.tolist()]


def equal_rows(rows: Tensor) -> Clusters:
    """The groups of a fresh run (every group holds one model): one cluster per distinct row."""
    return by_key(range(rows.shape[0]), row_keys(rows))


def next_clusters(clusters: Clusters, rows: Tensor, treatment: Sequence[Hashable],
                  common: Sequence[Hashable] = ()) -> Clusters:
    """The clusters after one vote.

    Args:
        clusters: the clusters before it.
        rows: every group's new rows (multipliers and explored values).
        treatment: what the vote did to each group's parameters and optimizer state, one hashable value per group
            (e.g. its merge strengths and whether it restarts): members treated differently no longer hold one model.
        common: where every group took one state (a roll-back, the search's end), what each group took (e.g.
            whether from the initial model); the groups with equal rows and equal ``common`` form the clusters.
            Empty: no common state.
    """
    if common:
        keys = [(row, took) for row, took in zip(row_keys(rows), common)]
        return by_key(range(rows.shape[0]), keys)
    keys = [(row, how) for row, how in zip(row_keys(rows), treatment)]
    return _ordered([part for cluster in clusters for part in by_key(cluster, keys)])


def after_vote(clusters: Clusters, rows: Tensor, decision: Any) -> Clusters:
    """The clusters after a vote's ``decision`` (a :class:`~lightning_hdet.hdet.rules.controller.Decision`) was
    carried out, ``rows`` the groups' new rates: at a roll-back every group took the restore point (or the initial
    model, ``from_initial``); otherwise each group's merge strengths and optimizer restart say how it was treated, and
    a group that copied another whole, at its rates, joins it."""
    groups = rows.shape[0]
    if decision.roll_back:
        return next_clusters(clusters, rows, [], list(decision.from_initial) or [False] * groups)
    plan, restart = decision.plan, decision.restart
    treatment = [(tuple(float(step.strengths[g]) for step in plan), bool(restart[g])) for g in range(groups)]
    kept = next_clusters(clusters, rows, treatment)
    return _join_copies(kept, rows, plan, restart)


def _join_copies(clusters: Clusters, rows: Tensor, plan: Sequence[Any], restart: Sequence[bool]) -> Clusters:
    """Each group that took exactly one whole copy of an untouched source, kept its optimizer state and has the
    source's row moves into the source's cluster."""
    keys, touched = row_keys(rows), {g for step in plan for g, s in enumerate(step.strengths) if s != 0.0}
    home = {g: i for i, c in enumerate(clusters) for g in c}
    for step in plan:
        sources = [h for h, c in enumerate(step.coefficients) if c != 0.0]
        if len(sources) != 1 or step.coefficients[sources[0]] != 1.0 or sources[0] in touched:
            continue
        for g, strength in enumerate(step.strengths):
            took_one = sum(1 for other in plan if other.strengths[g] != 0.0) == 1
            if strength == 1.0 and took_one and not restart[g] and keys[g] == keys[sources[0]]:
                home[g] = home[sources[0]]
    return _ordered(by_key(range(rows.shape[0]), [home[g] for g in range(rows.shape[0])]))


def _ordered(clusters: Clusters) -> Clusters:
    return sorted((sorted(c) for c in clusters if c), key=lambda c: c[0])


def check_clusters(clusters: Clusters, num_groups: int) -> None:
    """A partition of the ``num_groups`` groups into non-empty lists."""
    ok = isinstance(clusters, list) and all(isinstance(c, list) and c for c in clusters)
    ok = ok and sorted(g for c in clusters for g in c) == list(range(num_groups))
    require("clusters", clusters, ok,
            f"lists of group indices covering 0..{num_groups - 1} once each, e.g. [[0], [1, 2], [3]]")


def cluster_of(clusters: Clusters, group: int) -> list[int]:
    """The cluster that holds ``group``."""
    return next(c for c in clusters if group in c)
