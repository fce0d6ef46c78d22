"""Pulls that send only what changed (pure): rank 0's *public model* ``P`` and its log of compressed changes.

With a delta pull codec the workers train from ``P``: after a batch moved the global model ``G``, rank 0 logs ``D =
codec(G - P)`` and adds ``decode(D)`` to ``P``; a worker at version ``u`` gets the changes after ``u`` and adds them,
oldest first, so both hold ``P`` bit for bit; what a change left out stays in ``G - P`` (pull-side error feedback,
as DoubleSqueeze). ``G`` is never rounded. A worker with no version, or one older than the log (at most
``max_log_bytes``, default one float32 model), gets ``P`` in ``float32`` (a counted *dense* pull).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from lightning_hdet.asynchronous.wire.messages import Fragments


class PublicModel:
    """The public model ``P`` (from ``params``, copied), its logged changes and the version each worker holds."""

    def __init__(self, params: Tensor, layout: Fragments, max_log_bytes: int | None = None) -> None:
        if not layout.delta_codecs:
            raise ValueError("PublicModel needs a layout with a delta pull codec (int8, topk2 or topk4).")
        self.layout = layout
        self.params = params.detach().to(torch.float32, copy=True)
        self.version = 0
        self.max_log_bytes = 4 * layout.numel if max_log_bytes is None else max_log_bytes
        self._log: deque[tuple[int, list[Tensor]]] = deque()  # (version, one message per fragment)
        self._log_bytes = 0
        self._held: dict[int, int] = {}  # worker -> the version of P it holds
        self._source = -1  # the outer version last published
        self._diff = torch.empty(layout.largest, dtype=torch.float32)

    @property
    def change_nbytes(self) -> int:
        return self.layout.reply_nbytes(1)

    @property
    def logged(self) -> int:
        return len(self._log)

    @torch.no_grad()
    def publish(self, params: Tensor, source_version: int, change: list[Tensor] | None = None) -> None:
        """Move ``P`` toward ``params`` by one logged change (``change``: SparseLoCo's round; else encoded)."""
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
        """What ``worker``'s pull carries: ``(n, changes)``, or ``(-1, P's fragments)`` (dense)."""
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
        """Drop the changes every worker holds, then the oldest beyond the log's bound."""
        needed = min(self._held.values(), default=self.version)
        while self._log and (self._log[0][0] <= needed or self._log_bytes > self.max_log_bytes):
            self._log.popleft()
            self._log_bytes -= self.change_nbytes
