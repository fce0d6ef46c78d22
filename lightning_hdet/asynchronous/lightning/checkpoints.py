"""The strategy's checkpoint files: rank 0 writes the Lightning checkpoint with the outer state, and every worker
writes its own inner optimizer state (and its error-feedback residual) to a file beside it, so that inner states
never travel to rank 0.

While the workers train apart, **rank 0 alone decides** (best, last, periodic: Lightning's ``ModelCheckpoint``
runs its decisions on rank 0, which alone validates). Each checkpoint rank 0 writes is a numbered *request*: its
snapshot of the global model records, for every worker, how many of its exchanges the model holds (``exchanges``);
every reply from then on carries the request's number (:attr:`~.messages.ServerHeader.checkpoints`), and the
request itself (the path, the exchanges) waits in the default process group's store (:class:`CheckpointRequests`).
Each worker keeps a host copy of its own state as of its latest exchange; at its next reply it writes
``path.worker{w}.pt`` (:func:`worker_file`) from that copy or from its state then, whichever is of the exchange the
checkpoint's model holds, so the files are consistent with the global model saved (DiLoCo: the round boundary; async:
each worker's latest exchange). Removals travel the same way. Requests a worker can no longer hear of in a reply
(made after its last one) are followed when every rank meets again at the end of training. A file whose state was not
kept says so (``{"missing": why}``), and so does the log. With ``checkpoint_inner_states`` the states travel in
the pushes and rank 0's file holds them.

Outside training (``trainer.save_checkpoint(path)`` on every rank, Lightning's contract) each worker ``w`` (its
leader, for a worker of several ranks: its ranks hold the same state) writes its state then. ``fit(ckpt_path=
path)`` then gives each worker (every rank of it) its own file back; a worker without one (e.g. a run resumed on
more workers) starts from rank 0's state, with a warning. With FSDP2 inside workers each rank writes its own shard,
``path.worker{w}.shard{j}.pt``, with the worker's number of shards; a run resumed with another ``ranks_per_worker``
reshards each worker's state from its old shards (:func:`~.reshard.reshard_optimizer_state`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.cloud_io import get_filesystem
from typing_extensions import override

from lightning_hdet._checkpoint import read_checkpoint
from lightning_hdet._compat import weights_only_kwargs
from lightning_hdet._tensors import state_from_bytes, state_to_bytes
from lightning_hdet.asynchronous.exchange.exchange import Exchange
from lightning_hdet.asynchronous.exchange.reshard import reshard_optimizer_state
from lightning_hdet.asynchronous.exchange.worker import Worker
from lightning_hdet.asynchronous.exchange.worker_shards import local_state, sharded_optimizer_state
from lightning_hdet.asynchronous.lightning.rank_groups import RankGroups

log = logging.getLogger(__name__)

#: The key of the outer state in a Lightning checkpoint.
CHECKPOINT_KEY = "async_local_sgd"


def worker_file(filepath: Any, worker: int, shard: int | None = None) -> str:
    """The file beside the checkpoint ``filepath`` that holds ``worker``'s own state (with one rank per worker, the
    worker is the rank); with FSDP2 inside workers, one per rank: the worker's ``shard``-th rank's."""
    return f"{filepath}.worker{worker}.pt" if shard is None else f"{filepath}.worker{worker}.shard{shard}.pt"


class CheckpointRequests:
    """Rank 0's checkpoint writes and removals while the workers train apart, for the other workers to follow with
    their own files, through a key-value store (the default process group's; any object with ``set(key, value)``
    and a ``get(key)`` that waits for the key, e.g. a fake in tests). ``fit`` keeps one ``fit``'s numbers apart from
    another's."""

    def __init__(self, store: Any, fit: int) -> None:
        self.store, self.fit = store, fit

    def _key(self, number: int) -> str:
        return f"lightning_hdet/async/fit{self.fit}/checkpoint{number}"

    def post(self, number: int, op: str, path: Any = None, exchanges: Mapping[int, int] | None = None) -> None:
        """Request ``number``: ``op`` ``"save"`` (each worker writes its file beside ``path``, with its state as of
        its ``exchanges[w]``-th exchange), ``"remove"`` (its file beside ``path``) or ``"none"``."""
        value = {"op": op, "path": None if path is None else str(path),
                 "exchanges": {str(w): int(c) for w, c in (exchanges or {}).items()}}
        self.store.set(self._key(number), json.dumps(value))

    def read(self, number: int) -> dict[str, Any]:
        """Request ``number`` (waits until rank 0 posted it: a number is taken just before the file is written)."""
        value = json.loads(self.store.get(self._key(number)))
        return {**value, "exchanges": {int(w): c for w, c in value["exchanges"].items()}}


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
    #: True while the workers train apart (set by the subclass): only rank 0's checkpoint decisions count; and
    #: True once this rank left the exchange (its state is final).
    training_apart = False
    left_exchange = False
    #: While training apart: rank 0's requests (``None``: none are made, e.g. with ``checkpoint_inner_states``),
    #: how many this rank followed, and its own state as of its latest exchange ``(exchange, serialized)``.
    _requests: CheckpointRequests | None = None
    _followed = 0
    _kept: tuple[int, Any] | None = None
    _keeping = False
    _fits = 0

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        outer = self._exchange.outer if self._exchange is not None else None
        snapshot, self._outer_snapshot = self._outer_snapshot, None
        request = snapshot.pop("request", None) if snapshot is not None else None
        if self.is_global_zero and outer is not None:
            # the snapshot checkpoint["state_dict"] was built from (pushes applied since must not split the two)
            checkpoint = {**checkpoint, CHECKPOINT_KEY: snapshot if snapshot is not None else outer.state_dict()}
        whole = bool(self.optimizers) and "optimizer_states" in checkpoint  # not for weights-only ones
        exchanges = snapshot["exchanges"] if whole and request is not None else {}
        if request is not None and self._requests is not None:  # posted first: a worker that heard of it waits
            self._requests.post(request, "save" if whole else "none", filepath, exchanges)
            self._followed = max(self._followed, request)
        super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes
        if self.training_apart:  # rank 0's decision: its own file now, the others' at their next reply
            if whole and request is not None:  # between exchanges; once it left, its state is that of its last
                now = self._exchange.worker.exchanges if self.left_exchange and self._exchange else None
                self._write_own(filepath, exchanges.get(self.worker_ranks.worker, 0), now)
            return
        own_file = self._own_file(filepath)
        if whole and own_file:
            self.checkpoint_io.save_checkpoint(self._own_state(), own_file)

    def take_snapshot(self) -> dict[str, Any] | None:
        """Rank 0 while training apart: one snapshot of the outer state, the checkpoint's model and outer state both
        (reused by :meth:`save_checkpoint`), numbered as a request when the workers follow requests; ``None``
        elsewhere. A snapshot taken and not saved (its request unused) is posted as nothing to do."""
        previous, outer = self._outer_snapshot, self._exchange.outer if self._exchange is not None else None
        if previous is not None and "request" in previous and self._requests is not None:
            self._requests.post(previous["request"], "none")
        snapshot = None
        if self.training_apart and outer is not None:
            snapshot = outer.state_dict(request=self._requests is not None)
        self._outer_snapshot = snapshot
        return snapshot

    def _own_state(self) -> dict[str, Any]:
        """What this rank writes beside a checkpoint: its inner optimizer state and error-feedback residual now."""
        own: dict[str, Any] = {"optimizer": self.optimizer_state(self.optimizers[0])}
        if self._exchange is not None:
            own["error_feedback"] = self._exchange.worker.feedback.state_dict()
        if self.inside_worker == "fsdp":  # a resume with another k reads all of them (see _shard_resume)
            own["shards"] = self.worker_ranks.ranks_per_worker
        return own

    def follow_checkpoints(self, store: Any, keep: bool) -> None:
        """Training apart starts: follow rank 0's checkpoint requests through ``store`` (see the module docstring);
        ``keep``: hold a host copy of this worker's state as of each exchange (a checkpoint callback may ask for
        it; without one, a checkpoint rank 0 writes says its workers' states were not kept)."""
        self._fits += 1  # every rank runs the same entries: one number per fit keeps their requests apart
        self._requests = CheckpointRequests(store, self._fits)
        self._followed, self._kept = 0, None
        self._keeping = keep and self._own_file("") is not None  # a worker's other DDP ranks write nothing

    def after_exchange(self) -> None:
        """After each exchange of this worker (its reply taken): follow the requests the reply announced, then keep
        its state as of this exchange."""
        if self._requests is None or self._exchange is None:
            return
        worker = self._exchange.worker
        if not self.is_global_zero:  # rank 0 wrote its own file as it made each request
            self._follow_requests(worker.checkpoints, now=worker.exchanges)
        if self._keeping:
            self._kept = (worker.exchanges, state_to_bytes(self._own_state()))

    def finish_checkpoints(self, groups: tuple[Any, Any] | None) -> None:
        """Every worker left (collectives meet again): follow rank 0's requests made after this worker's last reply
        (rank 0 says how many it made, over the exchange's reply group), with its state as of its leaving push;
        then no more."""
        outer = self._exchange.outer if self._exchange is not None else None
        count = torch.tensor([outer.counts.requests if outer is not None else 0], dtype=torch.int64)
        dist.broadcast(count, src=0, group=groups[1] if groups is not None else None)
        requests = int(count)
        snapshot, self._outer_snapshot = self._outer_snapshot, None
        if self._requests is not None and snapshot is not None and "request" in snapshot:
            self._requests.post(snapshot["request"], "none")  # taken, never saved
        elif self._requests is not None and self._exchange is not None and not self.is_global_zero:
            self._follow_requests(requests, now=self._exchange.worker.exchanges)
        self._requests, self._kept = None, None
        # every file is written when fit returns (and rank 0, which hosts the store, waits for the reads)
        dist.barrier(group=groups[1] if groups is not None else None)

    def _follow_requests(self, upto: int, now: int) -> None:
        assert self._requests is not None
        for number in range(self._followed + 1, upto + 1):
            request = self._requests.read(number)
            own = self._own_file(request["path"]) if request["path"] is not None else None
            if request["op"] == "remove" and own and get_filesystem(own).exists(own):
                self.checkpoint_io.remove_checkpoint(own)
            elif request["op"] == "save":
                self._write_own(request["path"], request["exchanges"].get(self.worker_ranks.worker, 0), now)
        self._followed = max(self._followed, upto)

    def _write_own(self, filepath: Any, exchange: int, now: int | None) -> None:
        """Write this rank's file beside ``filepath`` with its state as of its ``exchange``-th exchange: its state
        now (``now``: the exchange it has just done, ``None``: between exchanges) or the copy it kept; or, neither
        being of that exchange, a file that says so."""
        own_file = self._own_file(filepath)
        if own_file is None:
            return
        exchange = max(exchange, 1)  # the first exchange (HELLO) takes no steps: before it, the state is the same
        kept = self._kept
        if now == exchange:
            state = self._own_state()
        elif kept is not None and kept[0] == exchange:
            state = state_from_bytes(kept[1])
        else:
            why = (f"its state as of its exchange {exchange}, which the checkpoint's global model holds last, was not"
                   f" kept ({'no checkpoint callback' if not self._keeping else f'it holds exchange {kept and kept[0]}'})")
            log.warning("%s: %s; %s says so and a resume starts it from rank 0's inner state.",
                        self.worker_ranks.describe(), why, own_file)
            state = {"missing": why}
        self.checkpoint_io.save_checkpoint(state, own_file)

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
        if self.training_apart and not self.is_global_zero:
            return  # rank 0's decisions count; its request reaches this worker
        own = self._own_file(filepath)
        if own and get_filesystem(own).exists(own):
            self.checkpoint_io.remove_checkpoint(own)
        outer = self._exchange.outer if self._exchange is not None else None
        if self.training_apart and self._requests is not None and outer is not None:
            with outer.model_lock:
                number = outer.counts.reserve()
            self._requests.post(number, "remove", filepath)
            self._followed = max(self._followed, number)

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
            if "missing" in self._resume_worker:
                log.warning("%s: %s holds no state: %s.", self.worker_ranks.describe(), own,
                            self._resume_worker["missing"])
                self._resume_worker = None
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
        if "missing" in head:
            log.warning("%s: %s holds no state: %s.", ranks.describe(), first, head["missing"])
            return None
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
