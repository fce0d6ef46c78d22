"""Which ranks average their gradients together: every HDET group's process group, and the clusters of groups of
``gradient_sync="cluster"`` with theirs (:mod:`~lightning_hdet.hdet.clusters`).

:class:`GradientGroups` is mixed into :class:`~lightning_hdet.hdet.lightning.groups.HDETGroups`, so every HDET
strategy answers ``clusters`` and ``gradient_ranks``; the DDP strategies (the Trainer's and Fabric's) build their
gradient's process group from :meth:`GradientGroups._gradient_process_group` (``"hdet_fsdp"`` refuses clusters).
The host provides ``gradient_sync``, ``layout``, ``num_groups``, ``group_index``, ``root_device``, ``rate_rows()``,
``_group_pgs`` (set by its distributed set-up from :meth:`_new_group_process_groups`) and ``_apply_gradient_sync``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hdet.hdet.clusters import Clusters, check_clusters, cluster_of, equal_rows, for_sync
from lightning_hdet.hdet.layout import GroupLayout


class GradientGroups:
    """The groups' and clusters' process groups, and the clusters themselves (one owner: the strategy)."""

    # The host's (set in its ``__init__`` and distributed set-up; see the module docstring).
    _clusters: Optional[Clusters]  # under "cluster": set at the first wrap, then by the votes
    _cluster_pgs: dict[tuple[int, ...], Any]  # the process group of each cluster of several groups
    _group_pgs: list[Any]
    gradient_sync: str
    layout: GroupLayout
    group_index: int
    root_device: torch.device
    rate_rows: Callable[[], Tensor]
    _apply_gradient_sync: Callable[[], None]
    num_groups: int

    def _init_gradient_groups(self) -> None:
        """No clusters yet (call in the host's ``__init__``)."""
        self._clusters = None
        self._cluster_pgs = {}

    def _new_group_process_groups(self, timeout: Any) -> list[Any]:
        """One process group per HDET group (call on every rank, after the default group exists)."""
        # Every rank creates every group, in the same order. Except over gloo on GPUs: Lightning then binds the
        # default group to the device, and torch (2.11-2.13) has a rank outside a new group split gloo's
        # communicator, which gloo cannot do (AttributeError: perform_nocolor_split). The groups are disjoint, so
        # each rank can create only its own (the others stay None); NCCL keeps the faster split.
        own_only = self._own_groups_only()
        return [dist.new_group(self.layout.ranks(g), timeout=timeout, use_local_synchronization=own_only)
                for g in range(self.layout.num_groups)]

    def _own_groups_only(self) -> bool:
        """Whether a rank creates only the process groups it belongs to (gloo on GPUs, above)."""
        return self.root_device.type != "cpu" and dist.get_backend() == "gloo"

    def _cluster_process_group(self, ranks: list[int], timeout: Any) -> Any:
        """The process group of one cluster of several groups, made on first use and kept until teardown.

        Every rank reaches here for every new cluster, in the order of :attr:`clusters` (clusters change only at a
        vote, on every rank alike); over gloo on GPUs only the cluster's own ranks create it, as for the groups."""
        key = tuple(ranks)
        if key not in self._cluster_pgs:
            self._cluster_pgs[key] = dist.new_group(ranks, timeout=timeout,
                                                    use_local_synchronization=self._own_groups_only())
        return self._cluster_pgs[key]

    def _gradient_process_group(self, timeout: Any) -> Any:
        """The process group this rank averages gradients over under ``"group"`` / ``"cluster"`` (its group's, or its
        cluster's, creating every cluster's new process group first on every rank)."""
        if self.gradient_sync == "group":
            return self._group_pgs[self.group_index]
        clusters, own_only = self.clusters, self._own_groups_only()
        mine, pg = cluster_of(clusters, self.group_index), None
        for cluster in clusters:
            if len(cluster) > 1 and (cluster == mine or not own_only):
                made = self._cluster_process_group([r for g in cluster for r in self.layout.ranks(g)], timeout)
                pg = made if cluster == mine else pg
        return self._group_pgs[self.group_index] if len(mine) == 1 else pg

    @property
    def clusters(self) -> Clusters:
        """The groups that average one gradient, as lists of group indices (:mod:`~lightning_hdet.hdet.clusters`):
        every group alone under ``"group"``, all together under ``"global"``; under ``"cluster"`` the runs of
        groups at equal rates that hold one model, as the votes leave them."""
        if self.gradient_sync == "cluster" and self._clusters is None:  # a fresh run: every group holds rank 0's model
            self._clusters = equal_rows(self.rate_rows())
        return for_sync(self.gradient_sync, self.num_groups, self._clusters or [])

    def set_clusters(self, clusters: Clusters) -> None:
        """Under ``gradient_sync="cluster"``, the clusters from the next step on (on every rank, the same lists,
        between steps; only groups holding one model and optimizer state may share a cluster)."""
        check_clusters(clusters, self.num_groups)
        if self.gradient_sync != "cluster":
            return
        changed = self._clusters is not None and clusters != self._clusters
        self._clusters = [list(c) for c in clusters]
        if changed:
            self._apply_gradient_sync()

    @property
    def gradient_ranks(self) -> list[int]:
        """The global ranks this rank averages its gradients with."""
        groups = cluster_of(self.clusters, self.group_index)
        return [r for g in groups for r in self.layout.ranks(g)]
