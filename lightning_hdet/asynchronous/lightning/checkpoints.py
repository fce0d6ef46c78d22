"""The strategy's checkpoint files: rank 0 writes the Lightning checkpoint with the outer state; every worker writes
its own inner optimizer state and error-feedback residual beside it (:func:`worker_file`; FSDP2 inside: each rank its
shard, resharded on a resume with another ``ranks_per_worker``).

While the workers train apart rank 0 alone decides. Each checkpoint it writes is a numbered *request* in the default
group's store (:class:`CheckpointRequests`): its snapshot records each worker's exchanges the model holds, and every
later reply carries the number; at its next reply (or when all ranks meet at the end) a worker writes its file from
its state then or the copy it kept of its latest exchange, whichever the model holds (DiLoCo: the round boundary), or
a file that says the state was not kept. Removals travel the same way."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
from lightning_hdet.asynchronous.outer.state import OuterState

log = logging.getLogger(__name__)

#: The key of the outer state in a Lightning checkpoint.
CHECKPOINT_KEY = "async_local_sgd"


def worker_file(filepath: Any, worker: int, shard: int | None = None) -> str:
    """The file beside ``filepath`` with ``worker``'s own state (FSDP2 inside: its ``shard``-th rank's)."""
    return f"{filepath}.worker{worker}.pt" if shard is None else f"{filepath}.worker{worker}.shard{shard}.pt"


class CheckpointRequests:
    """Rank 0's checkpoint writes and removals, numbered in a key-value ``store``, one ``fit`` apart. Each is posted
    in two parts: the exchanges its snapshot holds, as soon as it is numbered (a worker that hears of it keeps its
    state as of them), and what became of it (written to paths, a removal, nothing) once rank 0 knows: a snapshot
    taken when validation starts is saved, or not, when it ends, and no worker waits for that."""

    def __init__(self, store: Any, fit: int) -> None:
        self.store, self.fit = store, fit

    def _key(self, number: int, part: str) -> str:
        return f"lightning_hdet/async/fit{self.fit}/checkpoint{number}/{part}"

    def reserve(self, number: int, exchanges: Mapping[int, int] | None) -> None:
        """Request ``number`` holds each worker's ``exchanges`` (``None``: a removal, no state)."""
        value = None if exchanges is None else {str(w): int(c) for w, c in exchanges.items()}
        self.store.set(self._key(number, "at"), json.dumps(value))

    def post(self, number: int, op: str, paths: Sequence[Any] = ()) -> None:
        """What became of request ``number``: ``"save"`` to ``paths``, ``"remove"`` them, or ``"none"``."""
        self.store.set(self._key(number, "op"), json.dumps({"op": op, "paths": [str(p) for p in paths]}))

    def reservation(self, number: int) -> dict[int, int] | None:
        """The exchanges request ``number`` holds (waits: rank 0 posts them as it numbers the request)."""
        value = json.loads(self.store.get(self._key(number, "at")))
        return None if value is None else {int(w): c for w, c in value.items()}

    def decision(self, number: int, wait: bool) -> dict[str, Any] | None:
        """What became of request ``number``; ``None`` if rank 0 has not said yet and ``wait`` is false."""
        key = self._key(number, "op")
        if not wait and not self.store.check([key]):
            return None
        return json.loads(self.store.get(key))


@dataclass
class _ValidationSnapshot:
    """Rank 0: the snapshot a validation scores, its request, and the checkpoints written with it."""

    snapshot: dict[str, Any]
    request: int | None  # None: the inner states travel in the snapshot (``checkpoint_inner_states``)
    paths: list[Any] = field(default_factory=list)


class WorkerCheckpoints(RankGroups):
    """Checkpoint hooks of :class:`~.strategy.AsyncLocalSGDStrategy` (see the module docstring)."""

    checkpoint_inner_states = False
    _exchange: Exchange | None = None
    _resume_state: dict[str, Any] | None = None
    _resume_worker: dict[str, Any] | None = None
    # rank 0: lightning_module_state_dict's snapshot for this checkpoint, its request, and this validation's
    _outer_snapshot: dict[str, Any] | None = None
    _snapshot_request: int | None = None
    _validation: _ValidationSnapshot | None = None
    training_apart = False
    left_exchange = False
    # while training apart: rank 0's requests (None: none made), how many this rank heard of, its state as of each
    # one rank 0 has not decided yet, and its own state as of its latest exchange (exchange, serialized)
    _requests: CheckpointRequests | None = None
    _followed = 0
    _pending: dict[int, Any]  # set by follow_checkpoints
    _kept: tuple[int, Any] | None = None
    _keeping = False
    _fits = 0

    @property
    def _outer(self) -> OuterState | None:
        """Rank 0's outer state while it has an exchange (``None`` elsewhere)."""
        return self._exchange.outer if self._exchange is not None else None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        outer = self._outer
        snapshot, request = self._outer_snapshot, self._snapshot_request
        self._outer_snapshot = self._snapshot_request = None
        if self.is_global_zero and outer is not None:
            # the snapshot checkpoint["state_dict"] was built from (pushes applied since must not split the two)
            checkpoint = {**checkpoint, CHECKPOINT_KEY: snapshot if snapshot is not None else outer.state_dict()}
        whole = bool(self.optimizers) and "optimizer_states" in checkpoint  # not for weights-only ones
        validation = self._validation if self._validation and snapshot is self._validation.snapshot else None
        if validation is not None:  # its request says what became of it when the validation ends
            request = validation.request
            if whole:
                validation.paths.append(filepath)
        elif request is not None and self._requests is not None:
            self._requests.post(request, "save" if whole else "none", [filepath] if whole else [])
        super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes
        own = self._own_file(filepath)
        if not whole or own is None:
            return
        if not self.training_apart:
            self.checkpoint_io.save_checkpoint(self._own_state(), own)
        elif request is not None and snapshot is not None:  # rank 0's: its file now, the others' at their next reply
            # between exchanges; once it left, its state is that of its last
            now = self._exchange.worker.exchanges if self.left_exchange and self._exchange else None
            self._write_state(own, self._capture(snapshot["exchanges"].get(self.worker_ranks.worker, 0), now))

    def take_snapshot(self) -> dict[str, Any] | None:
        """Rank 0 while training apart: one snapshot for the checkpoint's model and outer state, numbered (during a
        validation that keeps one: that one, the model its score measures)."""
        if self._validation is not None:
            self._outer_snapshot, self._snapshot_request = self._validation.snapshot, None
            return self._outer_snapshot
        if self._snapshot_request is not None and self._requests is not None:  # taken, never saved
            self._requests.post(self._snapshot_request, "none")
        self._outer_snapshot, self._snapshot_request = self._numbered_snapshot()
        return self._outer_snapshot

    def _numbered_snapshot(self) -> tuple[dict[str, Any] | None, int | None]:
        outer = self._outer
        if not (self.training_apart and outer is not None):
            return None, None
        snapshot = outer.state_dict(request=self._requests is not None)
        request = snapshot.pop("request", None)
        if request is not None and self._requests is not None:  # before any reply can announce it
            self._requests.reserve(request, snapshot["exchanges"])
        return snapshot, request

    def start_validation(self) -> dict[str, Any] | None:
        """Rank 0, async, while training apart with a checkpoint callback: the snapshot this validation scores and
        any checkpoint written at its end saves (the others' pushes meanwhile are in neither); else ``None``."""
        outer = self._outer
        if (outer is None or outer.step_policy.mode != "async" or self._validation is not None
                or not self.lightning_module.trainer.checkpoint_callbacks):
            return None  # DiLoCo: no round ends while rank 0 validates
        snapshot, request = self._numbered_snapshot()
        if snapshot is None:
            return None
        self._validation = _ValidationSnapshot(snapshot, request)
        return snapshot

    def end_validation(self) -> None:
        """Rank 0: say what became of this validation's snapshot (the workers write their files at their next reply)."""
        validation, self._validation = self._validation, None
        if validation is not None and validation.request is not None and self._requests is not None:
            self._requests.post(validation.request, "save" if validation.paths else "none", validation.paths)

    def _own_state(self) -> dict[str, Any]:
        own: dict[str, Any] = {"optimizer": self.optimizer_state(self.optimizers[0])}
        if self._exchange is not None:
            own["error_feedback"] = self._exchange.worker.feedback.state_dict()
        if self.inside_worker == "fsdp":  # a resume with another k reads all of them (see _shard_resume)
            own["shards"] = self.worker_ranks.ranks_per_worker
        return own

    def follow_checkpoints(self, store: Any, keep: bool) -> None:
        """Follow rank 0's requests through ``store``; ``keep``: copy this worker's state at each exchange."""
        self._fits += 1  # every rank runs the same entries: one number per fit keeps their requests apart
        self._requests = CheckpointRequests(store, self._fits)
        self._followed, self._kept, self._pending = 0, None, {}
        self._keeping = keep and self._own_file("") is not None  # a worker's other DDP ranks write nothing

    def after_exchange(self) -> None:
        """After each exchange: keep the state as of this exchange, then follow the requests the reply announced."""
        if self._requests is None or self._exchange is None:
            return
        worker, previous = self._exchange.worker, self._kept
        if self._keeping:
            self._kept = (worker.exchanges, state_to_bytes(self._own_state()))
        if not self.is_global_zero:  # rank 0 wrote its own file as it made each request
            self._follow_requests(worker.checkpoints, now=worker.exchanges, previous=previous)

    def finish_checkpoints(self, groups: tuple[Any, Any] | None) -> None:
        """Every worker left: follow the requests made after this worker's last reply; then no more."""
        outer = self._outer
        count = torch.tensor([outer.counts.requests if outer is not None else 0], dtype=torch.int64)
        dist.broadcast(count, src=0, group=groups[1] if groups is not None else None)
        if self._requests is not None and self._snapshot_request is not None:
            self._requests.post(self._snapshot_request, "none")  # taken, never saved
        elif self._requests is not None and self._exchange is not None and not self.is_global_zero:
            self._follow_requests(int(count), now=self._exchange.worker.exchanges, wait=True)
        self._outer_snapshot = self._snapshot_request = None
        self._requests, self._kept, self._pending = None, None, {}
        # every file is written when fit returns (and rank 0, which hosts the store, waits for the reads)
        dist.barrier(group=groups[1] if groups is not None else None)

    def _follow_requests(self, upto: int, now: int, previous: tuple[int, Any] | None = None,
                         wait: bool = False) -> None:
        """Keep this rank's state as of each request heard of; write or remove its files as rank 0 decided, in order
        (a removal never overtakes the save it removes); what rank 0 has not decided yet waits, never this rank."""
        assert self._requests is not None
        writes = self._own_file("") is not None
        for number in range(self._followed + 1, upto + 1):
            exchanges = self._requests.reservation(number)
            self._pending[number] = (self._capture(exchanges.get(self.worker_ranks.worker, 0), now, previous)
                                     if writes and exchanges is not None else None)
        self._followed = max(self._followed, upto)
        while self._pending:
            number = min(self._pending)
            decision = self._requests.decision(number, wait)
            if decision is None:
                break
            state = self._pending.pop(number)
            for path in decision["paths"]:
                own = self._own_file(path)
                if own is not None and decision["op"] == "remove" and get_filesystem(own).exists(own):
                    self.checkpoint_io.remove_checkpoint(own)
                elif own is not None and decision["op"] == "save" and state is not None:
                    self._write_state(own, state)
        for number, state in self._pending.items():  # undecided: must not move with this rank's next steps
            if isinstance(state, dict) and "missing" not in state:
                self._pending[number] = state_to_bytes(state)

    def _capture(self, exchange: int, now: int | None, previous: tuple[int, Any] | None = None) -> Any:
        """This rank's state as of its ``exchange``-th exchange (live, or serialized), or why it was not kept."""
        exchange = max(exchange, 1)  # the first exchange (HELLO) takes no steps: before it, the state is the same
        for kept in (self._kept, previous):
            if kept is not None and kept[0] == exchange:
                return kept[1]
        if now == exchange:
            return self._own_state()
        why = "no checkpoint callback" if not self._keeping else f"it holds exchange {self._kept and self._kept[0]}"
        return {"missing": f"its state as of its exchange {exchange}, which the checkpoint's global model holds last,"
                           f" was not kept ({why})"}

    def _write_state(self, own_file: str, state: Any) -> None:
        """Write this rank's file from :meth:`_capture`'s state (saying so where it was not kept)."""
        if isinstance(state, torch.Tensor):
            state = state_from_bytes(state)
        elif "missing" in state:
            log.warning("%s: %s; %s says so and a resume starts it from rank 0's inner state.",
                        self.worker_ranks.describe(), state["missing"], own_file)
        self.checkpoint_io.save_checkpoint(state, own_file)

    def _own_file(self, filepath: Any) -> str | None:
        """This rank's file beside ``filepath`` (the leader's, or FSDP2: each shard's); ``None``: it writes none."""
        ranks = self.worker_ranks
        if self.inside_worker == "fsdp":
            return worker_file(filepath, ranks.worker, self.global_rank - ranks.leader)
        return worker_file(filepath, ranks.worker) if ranks.is_leader else None

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The inner optimizer's state (FSDP2 inside: this rank's shard, plain tensors)."""
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
        outer = self._outer
        if self.training_apart and self._requests is not None and outer is not None:
            with outer.model_lock:
                number = outer.counts.reserve()
            self._requests.reserve(number, None)
            self._requests.post(number, "remove", [filepath])

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = read_checkpoint(lambda: super(WorkerCheckpoints, self).load_checkpoint(
            checkpoint_path, **weights_only_kwargs(weights_only)), checkpoint_path)
        self._resume_state = checkpoint.get(CHECKPOINT_KEY)
        own = self._own_file(checkpoint_path) or worker_file(checkpoint_path, self.worker_ranks.worker)
        self._resume_worker = (self._shard_resume(checkpoint_path, weights_only) if self.inside_worker == "fsdp"
                               else self._read_own(own, weights_only))
        return checkpoint

    def _read_own(self, path: str, weights_only: bool | None) -> dict[str, Any] | None:
        """A worker's file, or ``None`` if there is none or it says its state was not kept."""
        if not get_filesystem(path).exists(path):
            return None
        state = self.checkpoint_io.load_checkpoint(path, **weights_only_kwargs(weights_only))
        if "missing" in state:
            log.warning("%s: %s holds no state: %s.", self.worker_ranks.describe(), path, state["missing"])
            return None
        return state

    def _shard_resume(self, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any] | None:
        """FSDP2 inside: this rank's saved shard, resharded if the worker had another ``k``; else ``None``."""
        ranks = self.worker_ranks
        k, j = ranks.ranks_per_worker, self.global_rank - ranks.leader

        def read(shard: int) -> dict[str, Any]:
            path = worker_file(checkpoint_path, ranks.worker, shard)
            if not get_filesystem(path).exists(path):
                raise FileNotFoundError(f"{ranks.describe()}: {path} is missing, one of the {k_old} shard files of"
                                        f" worker {ranks.worker} the checkpoint was written with")
            return self.checkpoint_io.load_checkpoint(path, **weights_only_kwargs(weights_only))

        head = self._read_own(worker_file(checkpoint_path, ranks.worker, 0), weights_only)
        if head is None:
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
        """Each worker resumes its own inner optimizer state: the one sent to rank 0, else its file, else rank 0's
        (FSDP2 inside: this rank's shard from its file, else a fresh state)."""
        sent = (checkpoint.get(CHECKPOINT_KEY) or {}).get("inner_optimizer_states") or {}
        worker, saved = self.worker_ranks.worker, self._resume_worker
        if self.inside_worker == "fsdp" and saved is not None:
            self.optimizers[0].load_state_dict(sharded_optimizer_state(self.optimizers[0], saved["optimizer"]))
        elif self.inside_worker == "fsdp":
            log.warning("%s: the checkpoint has no inner optimizer state of this worker (%s absent or holding"
                        " none); it starts with a fresh one", self.worker_ranks.describe(),
                        worker_file("<checkpoint>", worker, 0).replace("shard0", "shard*"))
        elif worker in sent:
            self.optimizers[0].load_state_dict(sent[worker])
        elif saved is not None:
            self.optimizers[0].load_state_dict(saved["optimizer"])
        else:
            if worker:
                log.warning("%s: the checkpoint has no inner optimizer state of this worker (%s is absent or holds"
                            " none); it starts from rank 0's", self.worker_ranks.describe(),
                            worker_file("<checkpoint>", worker))
            super().load_optimizer_state_dict(checkpoint)

    def restore_worker(self, worker: Worker) -> None:
        saved = (self._resume_worker or {}).get("error_feedback")
        if saved is not None:
            worker.feedback.load_state_dict(saved)
        self._resume_worker = None
