"""One job's side of a DiLoCo round on torchft. No Lightning, no process group: the torchft ``Manager`` is injected
(its ``start_quorum``, ``allreduce``, ``should_commit`` and ``register_state_dict_fn``), so that a fake one runs
whole rounds in one process.

A round: at its start the job joins the quorum of live jobs (a job behind, e.g. new or restarted, heals there from
a live peer: the global model and the outer optimizer's state); after ``H`` inner steps it checks its
pseudo-gradient ``theta_global - theta_local`` (finite, a norm within ``max_norm_ratio`` times its own recent
median), takes the quorum again, shrink-only (a job frozen or dead during the inner steps misses it once the
Lighthouse's heartbeat timeout has passed, and the others reduce without it instead of waiting out ``timeout`` in
the allreduce), and sends it through one SUM allreduce of ``[pseudo-gradient, floating-point buffers, lineage bits,
1, accepted]``: a rejected job sends zeros and ``accepted = 0``, so the mean is over the accepted jobs (in bfloat16
with ``wire_dtype``: half the bytes, the sum rounded as it travels). If torchft commits the round
(every rank of the job saw the allreduce succeed), every job runs the same outer step on the mean; otherwise (a
peer died mid-round) the round is discarded. Either way the job restarts from the global model.

The lineage: a 32-bit hash chained over the reduced wires of the rounds a job committed (a healed job takes its
peer's). The jobs of one quorum hold the same global model exactly when they hold the same lineage; torchft heals by
round number only, so jobs that committed rounds in quorums apart (a split brain) would meet at one round with two
models and average on forever. Each job sends its lineage as 32 zeros and ones and a 1: every bit's sum is then 0
or the number of jobs (exact in bfloat16 too, up to 256 jobs) unless two lineages differ, which every job of the
quorum sees alike and ends with :class:`SplitBrainError`.

A live job later than the Lighthouse's join timeout at that second quorum is left out of it, and its own shrink-only
request can then never be met (torchft 0.2.0 answers a job only with a quorum that holds it): it waits at most
``round_end_timeout``, discards its round and takes a round's quorum again, where it heals from a live peer (the
strategy decides whether a round is left to meet the others at).
That needs one private attribute of torchft 0.2.0's ``Manager`` (:data:`FAILED_QUORUM`); :func:`require_supported`
refuses a ``Manager`` without it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer

from lightning_hdet._tensors import float_buffers, host_buffer, numel, read_into, write_from
from lightning_hdet.asynchronous.outer.checks import PushCheck

#: The key of this package's state among torchft's healing state.
STATE_KEY = "lightning_hdet"
#: Where torchft 0.2.0's ``Manager`` keeps its last quorum, whose failure its next ``start_quorum`` raises again: the
#: round's end forgets a failed one there (the ``Manager`` has no public way to).
FAILED_QUORUM = "_quorum_future"
#: How many bits of the lineage each round's wire carries (one value each).
LINEAGE_BITS = 32
#: The torchft release whose ``Manager`` this module was built and tested against (the ``torchft`` extra's pin).
SUPPORTED_TORCHFT = "0.2.0"


def require_supported(manager: Any, version: str) -> None:
    """Refuse a torchft ``Manager`` without :data:`FAILED_QUORUM` (``version``: the installed torchft's): forgetting
    a failed quorum would silently do nothing, and a job once left out of a round would end later, at the next
    round's start, with the re-raised TimeoutError."""
    if not hasattr(manager, FAILED_QUORUM):
        raise RuntimeError(
            f"TorchFTStrategy supports torchft {SUPPORTED_TORCHFT}, and the installed torchft is {version}: its "
            f"Manager has no `{FAILED_QUORUM}`, which a job left out of a round's end (later than the Lighthouse's "
            "--join_timeout_ms) resets to go on. Install the supported release, as the extra pins it: `pip install "
            f"torchft=={SUPPORTED_TORCHFT}` (or `pip install lightning-hdet[torchft]`).")


class SplitBrainError(RuntimeError):
    """The jobs of a round's quorum held different global models: some committed rounds in a quorum apart."""


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did: ``committed`` (torchft's vote: False when a peer failed during the round, which is then
    discarded), ``accepted`` (jobs whose pseudo-gradient passed their checks and went into the mean: the outer step
    ran if any) and ``rejected`` (this job's reason, ``None`` when it was accepted)."""

    committed: bool
    accepted: int
    rejected: Optional[str]
    left_out: bool = False  # late at the round's end: the live jobs reduced without this one


class ReplicaRound:
    """The global model, the outer optimizer and the checks of one job (every job holds the same), and its rounds.

    Args:
        module: the model on ``device`` (its parameters and floating-point buffers are the global model's start).
        device: where the module lives; the global model and the wire buffer are host tensors (pinned on CUDA).
        manager: this rank's torchft ``Manager`` (or a fake with the same methods).
        outer: builds the outer optimizer over the flat global parameters (e.g. ``DelayedNesterov`` with ``N = 1``).
        check: the pseudo-gradient's checks (``None``: none).
        wire_dtype: what the allreduce carries: ``float32`` or ``bfloat16`` (``BF16()``; ``accepted`` stays exact
            up to 256 jobs).
        round_end_timeout: how long the round's end waits for its shrink-only quorum (``None``: the manager's
            quorum timeout); past it the job was left out and discards its round.
    """

    def __init__(self, module: Module, device: torch.device, manager: Any,
                 outer: Callable[[Tensor], Optimizer], check: PushCheck | None,
                 wire_dtype: torch.dtype = torch.float32, round_end_timeout: Optional[timedelta] = None) -> None:
        self.module, self.device, self.manager, self.check = module, device, manager, check
        self.round_end_timeout = round_end_timeout
        self.tensors = list(module.parameters()) + float_buffers(module)
        self.n_params, self.size = numel(list(module.parameters())), numel(self.tensors)
        self.global_model = read_into(self.tensors, host_buffer(self.size, device), device)
        # [pseudo-gradient, buffers, lineage bits, 1 (this job), accepted]
        self.wire = host_buffer(self.size + LINEAGE_BITS + 2, device, wire_dtype)
        # the pseudo-gradient in float32, checked there (the wire itself unless it is narrower)
        self.delta = self.wire[: self.size] if wire_dtype == torch.float32 else host_buffer(self.size, device)
        self.optimizer = outer(self.global_model[: self.n_params])
        #: rounds in a row this job's pseudo-gradient was rejected in, and did not commit (left out of the round's
        #: end, or not committed by torchft), whatever the cause
        self.rejected_streak = self.discarded_streak = 0
        #: the hash chained over the reduced wires of the rounds this job committed (a heal brings its peer's)
        self.lineage = 0
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    def start(self) -> None:
        """A round's start: the quorum of the live jobs. A job behind heals here (:meth:`load_state_dict`)."""
        self.manager.start_quorum()

    def finish(self) -> RoundOutcome:
        """A round's end: check, reduce and (if committed) step; the module then holds the global model. Raises
        :class:`SplitBrainError` where the quorum's jobs held different global models."""
        n, size, wire, delta = self.n_params, self.size, self.wire, self.delta
        local = read_into(self.tensors, delta, self.device)
        torch.sub(self.global_model[:n], local[:n], out=local[:n])  # the pseudo-gradient, in place
        reason, norm = self._inspect()
        self._fill_wire(reason is None)
        if not self._round_end_quorum():
            self.discarded_streak += 1
            write_from(self.tensors, self.global_model, self.device)
            return RoundOutcome(False, 0, None, left_out=True)
        self.manager.allreduce(wire, reduce_op=ReduceOp.SUM).wait()
        committed = bool(self.manager.should_commit())
        accepted = 0
        if committed:  # a discarded round's wire may be partial: neither checked nor applied
            self._check_lineage()
            self._chain_lineage()
            accepted = int(round(float(wire[-1])))
        if accepted:
            mean = delta.copy_(wire[:size]).div_(accepted)
            params = self.optimizer.param_groups[0]["params"][0]
            params.grad = mean[:n]
            self.optimizer.step()
            params.grad = None
            self.global_model[n:].copy_(mean[n:])
        self.discarded_streak = 0 if committed else self.discarded_streak + 1
        if committed:  # a discarded round neither accepts nor rejects: nothing of it was applied
            self.rejected_streak = 0 if reason is None else self.rejected_streak + 1
            if reason is None and self.check is not None:
                self.check.accepted(0, norm)
        write_from(self.tensors, self.global_model, self.device)
        return RoundOutcome(committed, accepted, reason)

    def _fill_wire(self, accepted: bool) -> None:
        """This job's part of the sum: its pseudo-gradient and buffers and ``accepted = 1`` (zeros where rejected),
        its lineage's bits and a 1 (every job's, rejected or not: the quorum's jobs are compared)."""
        wire, size = self.wire, self.size
        if accepted:
            wire[:size].copy_(self.delta)  # a no-op where the wire is the delta
            wire[-1] = 1.0
        else:
            wire.zero_()
        bits = [float((self.lineage >> i) & 1) for i in range(LINEAGE_BITS)]
        wire[size:-1].copy_(torch.tensor(bits + [1.0]))

    def _check_lineage(self) -> None:
        """Every bit's sum is 0 or the number of jobs where the quorum's jobs hold one lineage; otherwise every job
        sees the same sums and stops here."""
        sums = [round(v) for v in self.wire[self.size:-1].tolist()]
        jobs, split = sums[-1], [i for i, total in enumerate(sums[:-1]) if total not in (0, sums[-1])]
        if not split:
            return
        same = min(sums[i] if (self.lineage >> i) & 1 else jobs - sums[i] for i in split)
        raise SplitBrainError(
            f"The {jobs} jobs of this round's quorum hold different global models (their lineages, the rounds each "
            f"committed, differ; at most {same} of them hold this job's): some committed rounds in a quorum apart from "
            "the others (a split brain: with TorchFT(min_replicas=...) at most half the jobs, a job whose heartbeats, "
            "or the others', were delayed past the Lighthouse's --heartbeat_timeout_ms can form a quorum of its own), "
            "and torchft heals by round number only, so the run would average one outer step over different models "
            "from here on. Every job of this quorum stops. Set min_replicas above half the jobs (two quorums apart "
            "cannot both reach it) and a --heartbeat_timeout_ms above the delays a loaded host puts on the beats; "
            "restart from one job's checkpoint: resume that job from it and start the others afresh (they heal from "
            "it).")

    def _chain_lineage(self) -> None:
        """The next lineage: a hash of this one and of the reduced wire (the same bits on every job of the quorum):
        the sum of its bytes as 32-bit words, modulo 2**32 (exact in any order, so alike on every machine; one
        vectorised integer pass a round, a tenth of the round's copies), and the bytes left over."""
        raw = self.wire.view(torch.uint8)
        words = raw[: raw.numel() // 4 * 4].view(torch.int32)
        total = int(words.sum(dtype=torch.int32)) % 2**32  # int32 accumulation wraps: the sum modulo 2**32
        rest = bytes(raw[words.numel() * 4:].tolist()).hex()
        digest = hashlib.blake2b(f"{self.lineage}:{total}:{rest}".encode(), digest_size=LINEAGE_BITS // 8).digest()
        self.lineage = int.from_bytes(digest, "little")

    def _round_end_quorum(self) -> bool:
        """The shrink-only quorum (no one joins mid-round; the missing leave); False where this job was left out."""
        try:
            self.manager.start_quorum(allow_heal=False, shrink_only=True, timeout=self.round_end_timeout)
        except TimeoutError:
            # torchft 0.2.0 keeps the failed quorum and raises it again at the next start_quorum: forget it, so that
            # the next round's quorum is asked for afresh
            setattr(self.manager, FAILED_QUORUM, None)
            return False
        return True

    def _inspect(self) -> tuple[Optional[str], float]:
        n, delta = self.n_params, self.delta
        if self.check is None:
            return None, math.nan
        reason, _, norm = self.check.inspect(0, [delta[:n]], [(0, n)], None)
        if reason is None and not bool(torch.isfinite(delta[n:]).all()):
            reason = "non-finite buffer values"
        return reason, norm

    def state_dict(self) -> dict[str, Any]:
        """What a healing job receives: the global model, its lineage and the outer optimizer's state (copies: the
        sender goes on while the transfer runs)."""
        return {"global_model": self.global_model.clone(), "lineage": self.lineage,
                "outer": {"state": {k: {name: v.clone() if isinstance(v, Tensor) else v for name, v in s.items()}
                                    for k, s in self.optimizer.state_dict()["state"].items()},
                          "param_groups": self.optimizer.state_dict()["param_groups"]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Heal: take a live peer's global model and outer state; the module restarts from the global model."""
        self.global_model.copy_(state["global_model"])
        self.lineage = int(state["lineage"])
        self.optimizer.load_state_dict(state["outer"])
        write_from(self.tensors, self.global_model, self.device)
