"""Pulls that send only what changed: rank 0's *public model* and its log of compressed changes. Pure tensor code:
no Lightning, no process groups.

With a delta pull codec (``pull_compression="int8"``) the workers train from a public copy ``P`` of the global
model ``G`` that follows it in compressed steps: when a batch of pushes has moved ``G``,
rank 0 encodes ``D = codec(G - P)`` fragment by fragment, adds ``decode(D)`` to ``P`` and logs ``D``. A worker that
holds version ``u`` of ``P`` is sent the changes ``u + 1 .. v`` and adds them, oldest first, to its own copy
(``theta_pulled``): both ends then hold ``P`` bit for bit (the same ``float32`` additions on the host, in the same
order). What a change did not carry stays in ``G - P`` and leaves with a later one: error feedback on the pull side,
as DoubleSqueeze (arXiv 1905.05957) compresses a parameter server's replies. ``G`` itself, what the outer optimizer
steps and what a run ends with, is never rounded. The code takes any codec that loses values; sparse ones (one
value in 64 a change) let ``P`` fall behind ``G`` under the outer Nesterov step, so the strategy offers them only
with ``outer="sparseloco"``, whose change is exactly sparse: there a change is not ``codec(G - P)`` but the round's
pushes forwarded as they are (:mod:`.sparse_outer`), and ``P`` equals ``G`` bit for bit.

A worker that holds no version (its first pull) or one older than the log receives ``P`` itself in ``float32``: a
*dense* pull, counted. The log keeps only the changes some remote worker still lacks, and at most
``max_log_bytes`` of them (by default one ``float32`` model: more changes than that weigh more than the model), so
rank 0 holds one model more (``P``) plus the log: in DiLoCo, where every worker pulls every version, the log is
empty between rounds; in async mode it holds what the slowest worker lacks.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from lightning_hdet.asynchronous.wire.messages import Fragments


class PublicModel:
    """The public model ``P``, its logged changes and the version each remote worker holds.

    Args:
        params: the global parameters ``G`` now (copied).
        layout: the fragments and their delta codecs (``layout.delta_codecs`` must not be empty).
        max_log_bytes: the most bytes of encoded changes kept (default: ``4 * layout.numel``).
    """

    def __init__(self, params: Tensor, layout: Fragments, max_log_bytes: int | None = None) -> None:
        if not layout.delta_codecs:
            raise ValueError("PublicModel needs a layout with a delta pull codec (int8, topk2 or topk4).")
        self.layout = layout
        self.params = params.detach().to(torch.float32, copy=True)
        #: The version ``params`` is at: how many changes were published.
        self.version = 0
        self.max_log_bytes = 4 * layout.numel if max_log_bytes is None else max_log_bytes
        self._log: deque[tuple[int, list[Tensor]]] = deque()  # (version, one message per fragment)
        self._log_bytes = 0
        self._held: dict[int, int] = {}  # worker -> the version of P it holds
        self._source = -1  # the outer version last published
        self._diff = torch.empty(layout.largest, dtype=torch.float32)

    @property
    def change_nbytes(self) -> int:
        """Bytes of one logged change (every fragment's message)."""
        return self.layout.reply_nbytes(1)

    @property
    def logged(self) -> int:
        """How many changes the log holds now."""
        return len(self._log)

    @torch.no_grad()
    def publish(self, params: Tensor, source_version: int, change: list[Tensor] | None = None) -> None:
        """Move ``P`` toward ``params`` (``G`` at outer version ``source_version``) by one logged change; nothing when
        ``G`` did not move since the last call. While no worker holds a version, ``P`` simply becomes ``G`` (the
        first pulls are dense anyway). ``change``: the change itself, one message per fragment, which moved ``G``
        exactly (``outer="sparseloco"``'s round, :mod:`.sparse_outer`); else ``codec(G - P)``. Call under the
        model's lock, before a batch's replies."""
        if source_version == self._source:
            return
        self._source = source_version
        if not self._held:
            self.params.copy_(params)
            return
        messages = []
        for index, ((start, end), codec) in enumerate(zip(self.layout.ranges, self.layout.delta_codecs)):
            out = self._diff[: end - start]
            if change is None:
                diff = torch.sub(params[start:end], self.params[start:end], out=out)
                message = codec.encode(diff, torch.empty(codec.nbytes, dtype=torch.uint8))  # type: ignore[union-attr]
            else:
                message = change[index]
            self.params[start:end].add_(codec.decode(message, out))
            messages.append(message)
        self.version += 1
        self._log.append((self.version, messages))
        self._log_bytes += self.change_nbytes
        self._trim()

    def reply(self, worker: int) -> tuple[int, list[Tensor]]:
        """What ``worker``'s pull carries now, in wire order: ``(n, messages)``, the ``n`` changes it lacks (oldest
        first, one message per fragment each), or ``(-1, P's fragments)`` when it holds no logged version (a dense
        pull). ``worker`` holds the current version afterwards."""
        held = self._held.get(worker)
        self._held[worker] = self.version
        oldest = self._log[0][0] if self._log else self.version + 1
        if held is None or held < oldest - 1:
            reply = -1, [self.params[start:end] for start, end in self.layout.ranges]
        else:
            reply = self.version - held, [m for version, messages in self._log if version > held for m in messages]
        self._trim()  # the reply's messages stay alive in the list it returns
        return reply

    def forget(self, worker: int) -> None:
        """``worker`` left: the changes only it lacked are dropped."""
        self._held.pop(worker, None)
        self._trim()

    def _trim(self) -> None:
        """Drop the changes every remote worker holds, then the oldest while the log weighs more than its bound."""
        needed = min(self._held.values(), default=self.version)
        while self._log and (self._log[0][0] <= needed or self._log_bytes > self.max_log_bytes):
            self._log.popleft()
            self._log_bytes -= self.change_nbytes
