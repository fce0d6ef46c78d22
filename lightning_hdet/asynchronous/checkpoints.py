"""The strategy's checkpoint files: rank 0 writes the Lightning checkpoint with the outer state, and every worker
writes its own inner optimizer state (and its error-feedback residual) to a file beside it, so that inner states
never travel to rank 0.

``trainer.save_checkpoint(path)`` runs on every rank (Lightning's contract; ``ModelCheckpoint`` calls it on every
rank): rank 0 writes ``path``; each worker ``w`` (its leader, for a worker of several ranks: its ranks hold the same
state) writes ``path.worker{w}.pt`` (:func:`worker_file`) with the state it holds at that moment. ``fit(ckpt_path=
path)`` then gives each worker (every rank of it) its own file back; a worker without one (e.g. a checkpoint its own
callback did not write, or a run resumed on more workers) starts from rank 0's state. With FSDP2 inside workers
each rank writes its own shard, ``path.worker{w}.shard{j}.pt``, with the worker's number of shards; a run resumed
with another ``ranks_per_worker`` reshards each worker's state from its old shards (:func:`~.reshard.
reshard_optimizer_state`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._compat import weights_only_kwargs
from lightning_hdet.asynchronous.rank_groups import RankGroups
from lightning_hdet.asynchronous.exchange import Exchange
from lightning_hdet.asynchronous.reshard import reshard_optimizer_state
from lightning_hdet.asynchronous.worker import Worker
from lightning_hdet.asynchronous.worker_shards import local_state, sharded_optimizer_state

log = logging.getLogger(__name__)

#: The key of the outer state in a Lightning checkpoint.
CHECKPOINT_KEY = "async_local_sgd"


def worker_file(filepath: Any, worker: int, shard: int | None = None) -> str:
    """The file beside the checkpoint ``filepath`` that holds ``worker``'s own state (with one rank per worker, the
    worker is the rank); with FSDP2 inside workers, one per rank: the worker's ``shard``-th rank's."""
    return f"{filepath}.worker{worker}.pt" if shard is None else f"{filepath}.worker{worker}.shard{shard}.pt"


class WorkerCheckpoints(RankGroups):
    """Checkpoint hooks of :class:`~.strategy.AsyncLocalSGDStrategy`: the outer state in rank 0's file, each
    worker's inner optimizer state and error-feedback residual in its own file (see the module docstring)."""

    #: Every exchange also sends the worker's inner optimizer state to rank 0 (set by the subclass).
    checkpoint_inner_states = False
    #: This process's part of the exchange during and after ``fit`` (set by the subclass).
    _exchange: Exchange | None = None
    _resume_state: dict[str, Any] | None = None
    _resume_worker: dict[str, Any] | None = None
    #: Rank 0: the outer state snapshot ``lightning_module_state_dict`` took for the checkpoint being written.
    _outer_snapshot: dict[str, Any] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        outer = self._exchange.outer if self._exchange is not None else None
        snapshot, self._outer_snapshot = self._outer_snapshot, None
        if self.is_global_zero and outer is not None:
            # the snapshot checkpoint["state_dict"] was built from (pushes applied since must not split the two)
            checkpoint = {**checkpoint, CHECKPOINT_KEY: snapshot if snapshot is not None else outer.state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes
        own_file = self._own_file(filepath)
        if self.optimizers and "optimizer_states" in checkpoint and own_file:  # not for weights-only ones
            own: dict[str, Any] = {"optimizer": self.optimizer_state(self.optimizers[0])}
            if self._exchange is not None:
                own["error_feedback"] = self._exchange.worker.feedback.state_dict()
            if self.inside_worker == "fsdp":  # a resume with another k reads all of them (see _shard_resume)
                own["shards"] = self.worker_ranks.ranks_per_worker
            self.checkpoint_io.save_checkpoint(own, own_file)

    def _own_file(self, filepath: Any) -> str | None:
        """This rank's file beside ``filepath``: its worker's (written by the leader), or with FSDP2 inside the
        worker its own shard's; ``None``: it writes none."""
        ranks = self.worker_ranks
        if self.inside_worker == "fsdp":
            return worker_file(filepath, ranks.worker, self.global_rank - ranks.leader)
        return worker_file(filepath, ranks.worker) if ranks.is_leader else None

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The inner optimizer's state; with FSDP2 inside workers, this rank's shard of it (plain tensors)."""
        state = super().optimizer_state(optimizer)
        return local_state(state) if self.inside_worker == "fsdp" else state

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # rank 0 removes
        own = self._own_file(filepath)
        if own and get_filesystem(own).exists(own):
            self.checkpoint_io.remove_checkpoint(own)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = read_checkpoint(lambda: super(WorkerCheckpoints, self).load_checkpoint(
            checkpoint_path, **weights_only_kwargs(weights_only)), checkpoint_path)
        self._resume_state = checkpoint.get(CHECKPOINT_KEY)
        own = self._own_file(checkpoint_path) or worker_file(checkpoint_path, self.worker_ranks.worker)
        self._resume_worker = None
        if self.inside_worker == "fsdp":
            self._resume_worker = self._shard_resume(checkpoint_path, weights_only)
        elif get_filesystem(own).exists(own):
            self._resume_worker = self.checkpoint_io.load_checkpoint(own, **weights_only_kwargs(weights_only))
        return checkpoint

    def _shard_resume(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """FSDP2 inside workers: this rank's shard of its worker's saved state. Its own file if the worker had as
        many shards then as now (``worker{w}.shard0.pt`` says how many); else all the old shards of its worker,
        resharded (a file of its name written with another ``k`` holds other rows); ``None`` without any."""
        ranks = self.worker_ranks
        k, j = ranks.ranks_per_worker, self.global_rank - ranks.leader

        def read(shard: int) -> dict[str, Any]:
            path = worker_file(checkpoint_path, ranks.worker, shard)
            if not get_filesystem(path).exists(path):
                raise FileNotFoundError(f"{ranks.describe()}: {path} is missing, one of the {k_old} shard files of"
                                        f" worker {ranks.worker} the checkpoint was written with")
            return self.checkpoint_io.load_checkpoint(path, **weights_only_kwargs(weights_only))

        first = worker_file(checkpoint_path, ranks.worker, 0)
        if not get_filesystem(first).exists(first):
            return None
        head = self.checkpoint_io.load_checkpoint(first, **weights_only_kwargs(weights_only))
        k_old = head["shards"]
        if k_old == k:
            return head if j == 0 else read(j)
        old = [head] + [read(i) for i in range(1, k_old)]
        log.info("%s: resharding its inner optimizer state from %d shards to %d", ranks.describe(), k_old, k)
        # the error-feedback residual is the full model's and only the leader's is used: shard 0's
        return {**head, "optimizer": reshard_optimizer_state([o["optimizer"] for o in old], k, j), "shards": k}

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each worker resumes its own inner optimizer state: the one it sent to rank 0 (with
        ``checkpoint_inner_states``), else its own file, else rank 0's."""
        sent = (checkpoint.get(CHECKPOINT_KEY) or {}).get("inner_optimizer_states") or {}
        worker = self.worker_ranks.worker
        if self.inside_worker == "fsdp":
            self._load_shard_state()
        elif worker in sent:
            self.optimizers[0].load_state_dict(sent[worker])
        elif self._resume_worker is not None:
            self.optimizers[0].load_state_dict(self._resume_worker["optimizer"])
        else:
            if worker:
                log.warning("%s: the checkpoint has no inner optimizer state of this worker (no file %s);"
                            " it starts from rank 0's", self.worker_ranks.describe(),
                            worker_file("<checkpoint>", worker))
            super().load_optimizer_state_dict(checkpoint)

    def _load_shard_state(self) -> None:
        """FSDP2 inside workers: this rank's shard of its worker's inner optimizer state (its own file, or resharded
        from the old ones, see :meth:`_shard_resume`); if its worker wrote no files, a fresh state."""
        if self._resume_worker is not None:
            optimizer = self.optimizers[0]
            optimizer.load_state_dict(sharded_optimizer_state(optimizer, self._resume_worker["optimizer"]))
        else:
            log.warning("%s: the checkpoint has no inner optimizer state of this worker (no files %s); it starts"
                        " with a fresh one", self.worker_ranks.describe(),
                        worker_file("<checkpoint>", self.worker_ranks.worker, 0).replace("shard0", "shard*"))

    def restore_worker(self, worker: Worker) -> None:
        """Give a new :class:`Worker` its error-feedback residual from the checkpoint it resumes (if any)."""
        saved = (self._resume_worker or {}).get("error_feedback")
        if saved is not None:
            worker.feedback.load_state_dict(saved)
        self._resume_worker = None
