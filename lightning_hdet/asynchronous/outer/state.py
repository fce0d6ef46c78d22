"""The outer side of Local-SGD (pure): global parameters and buffers, the outer optimizer (one parameter per
fragment, views of the flat global parameters, so pushes are applied fragment by fragment as they arrive), the step
budget and per-worker statistics. The two modes are step policies: :class:`AsyncStep` (each push on arrival, rounds
and budget by speed) and :class:`SyncStep` (DiLoCo: one step with the round's mean, equal rounds).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_hdet._checks import check_int
from lightning_hdet._tensors import state_from_bytes
from lightning_hdet.asynchronous.outer.checks import DISCARDED_BY_WORKER, PushCheck, buffers_problem
from lightning_hdet.asynchronous.outer.local_steps import LocalStepsPolicy
from lightning_hdet.asynchronous.outer.lookahead import LookaheadStep
from lightning_hdet.asynchronous.wire.messages import Kind, Push

log = logging.getLogger(__name__)

_STAT_KEYS = ("steps", "rounds", "local_steps", "steps_per_s", "staleness", "compute_s", "wait_s", "push_bytes",
              "pull_bytes", "dense_pulls", "rejected")


@dataclass
class WorkerStats:
    """What the outer side knows about one worker."""

    steps_per_s: float = 0.0
    local_steps: int = 0
    staleness: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    rounds: int = 0
    steps: int = 0
    pulled_version: int = 0
    in_flight: int = 0  # allocated in its latest reply, not pushed yet
    pending: int = 0  # taken after a push, before merging its reply (overlap): in its next push
    push_bytes: int = 0
    pull_bytes: int = 0  # 0 for rank 0's own worker: nothing travels
    dense_pulls: int = 0  # replies that sent the parameters themselves (delta pull codec)
    rejected: int = 0
    rejected_steps: int = 0
    rejected_streak: int = 0
    total_compute_s: float = 0.0
    total_wait_s: float = 0.0

    def time(self, compute_s: float, wait_s: float) -> None:
        self.compute_s, self.wait_s = compute_s, wait_s
        self.total_compute_s += compute_s
        self.total_wait_s += wait_s


class StepPolicy:
    """How a batch of pushes becomes outer updates and how long a worker's next round is; ``batch_window``:
    seconds after a batch's first push that later ones join it (``None``: until all have pushed)."""

    mode: str
    batch_window: float | None = None

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        """One arriving fragment of a push's pseudo-gradient."""

    def arrived(self, outer: OuterState) -> None:
        """A push's last fragment has arrived (under :attr:`~OuterState.model_lock` only)."""

    def pushed(self, outer: OuterState) -> None:
        """A push's last fragment has arrived (under both locks, after :meth:`arrived`)."""

    def close(self, outer: OuterState, pushes: int) -> None:
        """The batch closed; ``pushes`` of its pushes carried a pseudo-gradient."""

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        """``worker``'s next round length within the budget left."""
        raise NotImplementedError

    def keeps_messages(self, codecs: list, workers: int) -> object | None:
        """Where the server keeps each applied push's messages (``None``: nowhere)."""
        return None


class AsyncStep(StepPolicy):
    """Async Local-SGD: each push its own outer update (``grace_period``: a batch's window)."""

    mode = "async"

    def __init__(self, grace_period: float = 0.0) -> None:
        self.batch_window: float | None = grace_period
        self._staged: list[tuple[int, Tensor]] = []  # a push's fragments, when a lookahead needs it whole

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        if outer.lookahead is None:
            outer.step_fragment(index, gradient)
        else:  # copied: a stream may reuse its tensors for the next fragment
            self._staged.append((index, gradient.clone()))

    def arrived(self, outer: OuterState) -> None:
        staged, self._staged = self._staged, []  # cleared first: a score that raises leaves none behind
        if staged:  # outside the counters' lock: a lookahead scores three candidates here
            outer.step_update(staged)

    def pushed(self, outer: OuterState) -> None:
        outer.outer_updates += 1

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        steps = outer.local_steps.next_local_steps(worker)
        if outer.budget is None:
            return steps
        in_flight = sum(s.in_flight for w, s in outer.workers.items() if w != worker)
        return min(steps, outer.budget - outer.steps_done - in_flight - outer.pending_steps)


class SyncStep(StepPolicy):
    """DiLoCo: one outer update with the mean of the pushes; rounds of ``H / stagger``, the last to the budget."""

    mode = "sync"

    def __init__(self, stagger: int = 1) -> None:
        self.stagger = stagger
        self._sum: Tensor | None = None  # the round's summed pseudo-gradient: one model, not one per worker
        self._counts: list[int] = []  # per fragment, how many pushes are in the sum

    def receive(self, outer: OuterState, index: int, gradient: Tensor) -> None:
        if self._sum is None:
            self._sum, self._counts = torch.zeros_like(outer.params), [0] * len(outer.ranges)
        start, end = outer.ranges[index]
        self._sum[start:end].add_(gradient)
        self._counts[index] += 1

    def close(self, outer: OuterState, pushes: int) -> None:
        """One outer update: each fragment that pushes carried steps with their mean."""
        if not pushes:
            return
        if self._sum is not None:
            outer.step_update([(index, self._sum[start:end].div_(self._counts[index]))
                               for index, (start, end) in enumerate(outer.ranges) if self._counts[index]])
            self._counts = [0] * len(outer.ranges)
            self._sum.zero_()
        outer.outer_updates += 1

    def allocate(self, outer: OuterState, worker: int, n_waiting: int) -> int:
        steps = outer.local_steps.local_steps // self.stagger
        if outer.budget is None:
            return steps
        return min(steps, (outer.budget - outer.steps_done - outer.pending_steps) // n_waiting)


@dataclass
class ExchangeCounts:
    """For checkpoints (per run): each worker's exchanges the global model holds and rank 0's requests, numbered
    under the model lock so only replies after a snapshot carry its request."""

    exchanges: dict[int, int] = field(default_factory=dict)
    requests: int = 0

    def count(self, workers: Iterable[int]) -> None:
        """The model now holds a push of each of ``workers`` (applied or rejected)."""
        for w in workers:
            self.exchanges[w] = self.exchanges.get(w, 0) + 1

    def reserve(self) -> int:
        self.requests += 1
        return self.requests


@dataclass
class OuterState:
    """The outer optimizer's side (buffers: the mean of each worker's latest). :attr:`model_lock` guards the
    global model for a whole push, reply or snapshot; :attr:`lock`, the counters, is taken after it."""

    params: Tensor
    optimizer: Optimizer
    local_steps: LocalStepsPolicy
    step_policy: StepPolicy
    budget: int | None
    buffers: Tensor = field(default_factory=lambda: torch.zeros(0))
    steps_done: int = 0
    outer_updates: int = 0
    stop_requested: bool = False
    workers: dict[int, WorkerStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    model_lock: threading.Lock = field(default_factory=threading.Lock)
    metrics_version: int = 0
    inner_states: dict[int, Tensor] = field(default_factory=dict)  # serialized, only when workers send them
    worker_buffers: dict[int, Tensor] = field(default_factory=dict)
    check: PushCheck | None = None  # None: applied as it arrives, unchecked
    max_rejections: int = PushCheck.MAX_REJECTIONS
    follows_live: bool = False  # Delayed Nesterov's N follows the workers still training (async)
    configured_buffer: int | None = None  # the buffer_size given: the most N may follow up to
    parts: list[range] = field(default_factory=list)
    counts: ExchangeCounts = field(default_factory=ExchangeCounts)  # for checkpoints, per run
    lookahead: LookaheadStep | None = None  # picks each outer update's lr (None: the optimizer's own)

    def __post_init__(self) -> None:
        self.views: list[Tensor] = [p for group in self.optimizer.param_groups for p in group["params"]]
        ends = torch.tensor([v.numel() for v in self.views]).cumsum(0).tolist()
        self.ranges: list[tuple[int, int]] = list(zip([0, *ends[:-1]], ends))
        self._stage: Tensor | None = None  # a checked stream's fragments until its verdict (one push at a time)
        self._live: int | None = None  # workers still training, as last told (follow_live)

    def receive(self, push: Push, gradients: Iterable[Tensor], stable: bool = False) -> None:
        """One push and its fragments (maybe a stream still arriving). Unchecked, each is applied as it arrives;
        checked, each is kept (``stable``: the given tensors stay valid; else copied to one staging buffer) and the
        push applied only once all of it passed: a rejected one leaves no trace but its counts."""
        stream = iter(gradients)
        first = next(stream, None)  # waited for without the lock: a slow sender does not hold up the others
        fragments = stream if first is None else itertools.chain([first], stream)
        with self.model_lock:
            if push.kind == Kind.PUSH and push.steps == 0:  # a round the worker discarded itself
                for _ in fragments:
                    pass
                self._reject(push, DISCARDED_BY_WORKER)
            elif self.check is None:
                self._apply(push, fragments)
            else:
                if self._stage is None and not stable:
                    self._stage = torch.empty_like(self.params, requires_grad=False)
                ranges = [self.ranges[i] for i in self._indices(push.part)]
                stage = None if stable else self._stage
                reason, kept, norm = self.check.inspect(push.worker, fragments, ranges, stage, push.part)
                if reason is None and push.steps > 0 and self.ranges and not kept:
                    reason = "steps without a pseudo-gradient"
                reason = reason or buffers_problem(push.buffers, self.buffers.numel())
                if reason is None:
                    self._apply(push, kept)
                    if kept:
                        self.check.accepted(push.worker, norm, push.part)
                else:
                    self._reject(push, reason)
            if self.step_policy.mode == "async":  # DiLoCo: when the round closes
                self.counts.count([push.worker])

    def _apply(self, push: Push, fragments: Iterable[Tensor]) -> None:
        with self.lock:
            self._record(push)
        indices, count = self._indices(push.part), 0
        for gradient in fragments:
            if count < len(indices):
                self.step_policy.receive(self, indices[count], gradient)
            count += 1
        if count and count != len(indices):
            raise ValueError(f"A push has {len(indices)} fragments, got {count}.")
        if count:
            self.step_policy.arrived(self)
            with self.lock:
                self.step_policy.pushed(self)

    def _indices(self, part: int) -> range:
        return range(len(self.views)) if part < 0 else self.parts[part]

    def _reject(self, push: Push, reason: str) -> None:
        """Discard ``push`` whole (its steps return to the budget); only the rejection is counted."""
        push.rejected = reason
        with self.lock:
            stats = self.workers.setdefault(push.worker, WorkerStats())
            stats.in_flight = stats.pending = 0  # the worker drops its overlapped steps too: it restarts from the reply
            stats.time(push.compute_s, push.wait_s)
            stats.push_bytes += push.payload_bytes
            stats.rejected += 1
            stats.rejected_steps += push.steps
            stats.rejected_streak += 1
            streak = stats.rejected_streak
        log.warning("A push of worker %d was rejected: %s (%d in a row; %d stop the worker).%s", push.worker, reason,
                    streak, self.max_rejections, f" Its {push.steps} inner step(s) do not count." if push.steps else "")

    def rejection_streak(self, worker: int) -> int:
        with self.lock:
            stats = self.workers.get(worker)
            return stats.rejected_streak if stats is not None else 0

    def excluded(self, worker: int) -> bool:
        """``worker`` was rejected ``max_rejections`` times in a row: its replies say stop."""
        return self.rejection_streak(worker) >= self.max_rejections

    def close(self, pushes: list[Push]) -> dict[int, int]:
        """Close a batch by the step policy; the next round's length of each waiting worker (0: stop)."""
        with self.model_lock, self.lock:
            if any(p.buffers is not None and p.rejected is None for p in pushes):
                self.buffers.copy_(torch.stack(list(self.worker_buffers.values())).mean(0))
            # DiLoCo's mean is over the pushes applied: a rejected one is not in the sum
            self.step_policy.close(self, sum(p.steps > 0 and p.rejected is None for p in pushes))
            if self.step_policy.mode == "sync":
                self.counts.count(p.worker for p in pushes)
            self._resize_buffer()  # a change of N waits for a momentum boundary: retried at every batch
            waiting = [p.worker for p in pushes if p.kind != Kind.BYE]
            replies = {w: self._allocate(w, len(waiting)) for w in waiting}
            self.metrics_version += 1
            return replies

    def follow_live(self, live: int) -> None:
        """``live`` workers train: Delayed Nesterov's ``N`` becomes ``min(buffer_size, live)`` at a boundary."""
        with self.model_lock, self.lock:
            self._live = live
            self._resize_buffer()

    def _resize_buffer(self) -> None:  # under both locks; follows_live is set only where it is built as one
        if self.follows_live and self._live is not None:
            self.optimizer.follow(self._live, self.configured_buffer)  # type: ignore[attr-defined]

    def process(self, pushes: list[Push]) -> dict[int, int]:
        """:meth:`receive` and :meth:`close` whole pushes (one of the wrong shape as it is, for the checks); every
        waiting worker then pulls."""
        for push in pushes:
            g = push.pseudo_gradient
            whole = g is not None and g.dim() == 1 and g.numel() == self.params.numel()
            self.receive(push, [] if g is None else [g[s:e] for s, e in self.ranges] if whole else [g], stable=True)
        replies = self.close(pushes)
        for worker in replies:
            self.mark_pulled(worker)
        return replies

    def mark_pulled(self, worker: int, nbytes: int = 0, dense: bool = False) -> int:
        """``worker`` pulls now (under :attr:`model_lock`; ``nbytes`` travel); returns its version."""
        with self.lock:
            stats = self.workers[worker]
            stats.pulled_version = self.outer_updates
            stats.pull_bytes += nbytes
            stats.dense_pulls += dense
            return self.outer_updates

    def _record(self, push: Push) -> None:
        stats = self.workers.setdefault(push.worker, WorkerStats())
        stats.in_flight, stats.pending = 0, push.pending
        stats.time(push.compute_s, push.wait_s)
        stats.push_bytes += push.payload_bytes
        if push.inner_state is not None:
            self.inner_states[push.worker] = push.inner_state
        if push.buffers is not None:
            self.worker_buffers[push.worker] = push.buffers
        if push.steps > 0:
            stats.rejected_streak = 0
            stats.staleness = self.outer_updates - stats.pulled_version
            stats.rounds += 1
            stats.steps += push.steps
            self.steps_done += push.steps
            self.local_steps.update(push.worker, push.steps, push.compute_s, push.wait_s)
            stats.steps_per_s = self.local_steps.speeds.get(push.worker, 0.0)

    def step_update(self, fragments: list[tuple[int, Tensor]]) -> None:
        """One outer update of ``fragments`` (index, pseudo-gradient), at the lr the lookahead picks if one is set."""
        if self.lookahead is not None:
            self.lookahead.step(self, fragments)
        else:
            for index, gradient in fragments:
                self.step_fragment(index, gradient)

    def step_fragment(self, index: int, gradient: Tensor) -> None:
        """The outer step of one fragment (under :attr:`model_lock`)."""
        view = self.views[index]
        view.grad = gradient.to(view.dtype)
        self.optimizer.step()  # steps only the fragment with a gradient
        view.grad = None

    @property
    def pending_steps(self) -> int:
        """Steps taken after the latest pushes (overlap; under :attr:`lock`): not in the budget left."""
        return sum(s.pending for s in self.workers.values())

    def _allocate(self, worker: int, n_waiting: int) -> int:
        stats = self.workers[worker]
        stop = self.stop_requested or stats.rejected_streak >= self.max_rejections
        steps = 0 if stop else self.step_policy.allocate(self, worker, n_waiting)
        stats.in_flight = max(steps, 0)
        if steps > 0:
            stats.local_steps = steps
        return stats.in_flight

    def release(self, worker: int) -> None:
        """``worker`` left for good (an elastic session): its in-flight steps, speed and buffers no longer count."""
        with self.model_lock, self.lock:
            if worker in self.workers:
                self.workers[worker].in_flight = self.workers[worker].pending = 0
            self.local_steps.forget(worker)
            if self.worker_buffers.pop(worker, None) is not None and self.worker_buffers:
                self.buffers.copy_(torch.stack(list(self.worker_buffers.values())).mean(0))

    def request_stop(self) -> None:
        """Every worker's next reply says stop (e.g. EarlyStopping decided on rank 0)."""
        with self.lock:
            self.stop_requested = True

    def metrics(self) -> dict[str, float | int]:
        """The logged metrics (docs/async.md): counts as integers, rates and seconds as floats."""
        with self.lock:
            out: dict[str, float | int] = {"async/outer_updates": int(self.outer_updates)}
            if self.lookahead is not None:
                out["async/outer_lr"] = self.lookahead.lr(self)
            for w, s in sorted(self.workers.items()):
                for name in ("steps_per_s", "compute_s", "wait_s"):
                    out[f"async/worker{w}/{name}"] = float(getattr(s, name))
                for name in ("local_steps", "staleness", "rounds", "push_bytes", "pull_bytes", "rejected"):
                    out[f"async/worker{w}/{name}"] = int(getattr(s, name))
            return out

    def worker_stats(self) -> dict[int, dict[str, float]]:
        """Per-worker progress (:data:`_STAT_KEYS`)."""
        with self.lock:
            return {w: {k: getattr(s, k) for k in _STAT_KEYS} for w, s in sorted(self.workers.items())}

    def global_model(self) -> tuple[Tensor, Tensor]:
        with self.model_lock:
            return self.params.detach().clone(), self.buffers.clone()

    def state_dict(self, request: bool = False) -> dict[str, Any]:
        """A consistent snapshot; ``request``: a checkpoint's, numbered (:class:`ExchangeCounts`)."""
        with self.model_lock, self.lock:
            state = {
                "params": self.params.detach().clone(),
                "buffers": self.buffers.clone(),
                "worker_buffers": {w: b.clone() for w, b in sorted(self.worker_buffers.items())},
                "optimizer": self.optimizer.state_dict(),
                "policy": self.local_steps.state_dict(),
                "mode": self.step_policy.mode,
                "steps_done": self.steps_done,
                "outer_updates": self.outer_updates,
                "workers": {w: dict(vars(s)) for w, s in self.workers.items()},
                "exchanges": dict(self.counts.exchanges), **({"request": self.counts.reserve()} if request else {}),
            }
            inner = dict(self.inner_states)  # the stored tensors are replaced, never modified
        state["inner_optimizer_states"] = {w: state_from_bytes(data) for w, data in sorted(inner.items())}
        return state

    def load_state_dict(self, state: Mapping[str, Any], workers: int | None = None) -> None:
        """Restore a :meth:`state_dict` (on fewer ``workers``, the others' buffers no longer count)."""
        with self.model_lock, self.lock:
            for key, name, own in (("params", "parameters", self.params),
                                   ("buffers", "floating-point buffer values", self.buffers)):
                if state[key].numel() != own.numel():
                    raise ValueError(f"The checkpoint's outer state holds {state[key].numel()} {name} but the model"
                                     f" has {own.numel()}.")
            saved = sum(len(group["params"]) for group in state["optimizer"]["param_groups"])
            own = sum(len(group["params"]) for group in self.optimizer.param_groups)
            if saved != own:  # the outer optimizer holds one parameter per fragment: another layout
                raise ValueError(f"The checkpoint's outer optimizer holds {saved} fragment(s), this run {own}: it was "
                                 "saved with another fragment layout (e.g. another `stagger`). Resume with its settings.")
            self.params.data.copy_(state["params"])
            self.buffers.copy_(state["buffers"])
            self.worker_buffers = {int(w): b.float().clone() for w, b in state["worker_buffers"].items()
                                   if workers is None or int(w) < workers}
            self.optimizer.load_state_dict(state["optimizer"])
            self._resize_buffer()  # the checkpoint's N is its run's (1 once its workers stopped): follow this run's
            self.local_steps.load_state_dict(state["policy"])
            self.steps_done = int(state["steps_done"])
            self.outer_updates = int(state["outer_updates"])
            self.workers = {int(w): WorkerStats(**{**s, "in_flight": 0, "pending": 0})
                            for w, s in state["workers"].items()}


def check_stagger(stagger: int, mode: str, local_steps: int) -> None:
    """``stagger``: 1, or with DiLoCo a divisor of ``local_steps``."""
    check_int("stagger", stagger, minimum=1, hint="1 synchronises the whole model at once; F >= 2 (DiLoCo) in F"
              " parts, one every local_steps / F steps.")
    if stagger > 1 and mode != "sync":
        raise ValueError(f"`stagger={stagger}` applies to DiLoCo only (mode='sync'), got mode={mode!r}: an async"
                         " push is applied on arrival, with no common round to stagger. Use stagger=1, or"
                         " mode='sync'.")
    if local_steps % stagger:
        divisors = [d for d in range(1, local_steps + 1) if local_steps % d == 0]
        raise ValueError(f"`stagger={stagger}` does not divide local_steps={local_steps}: each part is synchronised"
                         f" every local_steps steps, one part every local_steps / stagger. Allowed: {divisors}.")
