"""What an async or DiLoCo run hands back (pure): :class:`AsyncResult`, built from the outer state at the end of
``fit`` or of an elastic service's run, with its summary (each worker's steps, rounds, rejections, bytes over the
wire both ways, waiting time) and a plain-dict export."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from lightning_hdet._text import counted


@dataclass(frozen=True)
class WorkerRecord:
    """One worker (a rank, or an elastic session) as the outer side saw it: its applied and rejected pushes and
    steps, bytes each way, seconds computing and waiting, and speed."""

    steps: int
    rounds: int
    rejected: int
    rejected_steps: int
    push_bytes: int
    pull_bytes: int
    total_compute_s: float
    total_wait_s: float
    steps_per_s: float


@dataclass(frozen=True)
class AsyncResult:
    """What one async (``mode="async"``) or DiLoCo (``mode="sync"``) run did: its budget and inner steps summed over
    the workers (``None``: no budget), outer updates, each worker's record by id (rank or elastic session), why each
    ended where known (``"left"``, ``"expired"``...), and ``local_worker``, the one in the outer optimizer's process
    (rank 0's), whose exchanges cross no wire."""

    mode: str
    budget: Optional[int]
    steps_done: int
    outer_updates: int
    workers: dict[int, WorkerRecord]
    ended: dict[int, str]
    local_worker: Optional[int] = None

    @property
    def rejected(self) -> int:
        return sum(w.rejected for w in self.workers.values())

    @property
    def push_bytes(self) -> int:
        """Payload bytes pushed over the wire (the in-process worker's cross none)."""
        return sum(r.push_bytes for w, r in self.workers.items() if w != self.local_worker)

    @property
    def pull_bytes(self) -> int:
        """Payload bytes the replies sent over the wire."""
        return sum(r.pull_bytes for w, r in self.workers.items() if w != self.local_worker)

    def summary(self) -> str:
        """The run in a few lines: the budget, the totals, then one line per worker."""
        name = "DiLoCo" if self.mode == "sync" else "Async Local-SGD"
        budget = f" of a budget of {self.budget}" if self.budget is not None else ""
        wire = self.push_bytes + self.pull_bytes
        lines = [f"{name} result: {self.steps_done} inner steps{budget} over {len(self.workers)} worker(s)",
                 f"  {counted(self.outer_updates, 'outer update')}, {self.rejected} push(es) rejected, "
                 f"{_size(wire)} on the wire ({_size(self.push_bytes)} out, {_size(self.pull_bytes)} in)"]
        for w in sorted(set(self.workers) | set(self.ended)):
            ended = f"; {self.ended[w]}" if w in self.ended else ""
            r = self.workers.get(w)
            if r is None:  # e.g. an elastic session that ended before its first push
                lines.append(f"  worker {w}: nothing pushed{ended}")
                continue
            rejected = f", {r.rejected} rejected ({r.rejected_steps} steps discarded)" if r.rejected else ""
            # out: its pushes, in: its pulls
            wire = "in-process" if w == self.local_worker else f"{_size(r.push_bytes)} out, {_size(r.pull_bytes)} in"
            lines.append(f"  worker {w}: {r.steps} steps in {counted(r.rounds, 'round')}{rejected}, {wire},"
                         f" {r.total_compute_s:.2f} s computing, {r.total_wait_s:.2f} s waiting{ended}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready; worker ids become strings), for scripts and notebooks."""
        out = asdict(self)
        out["workers"] = {str(w): asdict(r) for w, r in sorted(self.workers.items())}
        out["ended"] = {str(w): reason for w, reason in sorted(self.ended.items())}
        return out


def make_async_result(mode: str, budget: Optional[int], steps_done: int, outer_updates: int,
                      workers: Mapping[int, Mapping[str, Any]], ended: Optional[Mapping[int, str]] = None,
                      local_worker: Optional[int] = None) -> AsyncResult:
    """The result from the outer state's per-worker statistics."""
    records = {int(w): WorkerRecord(**{f.name: s.get(f.name, 0) for f in fields(WorkerRecord)})
               for w, s in workers.items()}
    return AsyncResult(mode, budget, int(steps_done), int(outer_updates), records, dict(ended or {}), local_worker)


def _size(n: int) -> str:
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
