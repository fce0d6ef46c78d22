"""Overlapping the exchange with compute (pure): the round's schedule and the correction at the merge.

With ``overlap_steps=τ`` a worker pushes ``τ`` steps before its round ends, trains on while the push and pull
travel, then merges ``θ ← θ_global_new + (θ_local_now − θ_local_at_send)``; ``θ_global_new`` is its next reference.

Why this merge and not Streaming DiLoCo's mix ``α θ_local_now + (1 − α) θ_global_new`` (arXiv 2501.18512):

* **No step is lost or counted twice**: the ``τ`` steps' displacement moves onto the new global model whole and
  goes into the next push whole, so ``max_steps`` stays an exact budget; the mix keeps only ``α`` of it.
* **``τ = 0`` is the blocking exchange, bit for bit**, with no second knob (``α``).
* **First-order, it is the blocking worker's round**: the overlapped gradients were taken at ``θ_local_at_send``
  instead of ``θ_global_new``, an ``O(lr · τ · ‖∇²L‖ · ‖θ_local_at_send − θ_global_new‖)`` delay of the kind async
  pushes already carry (as "eager updates", arXiv 2502.12996). With a conservative outer lr that gap is not
  small: the loss at a fixed budget grows with ``τ / H`` (``benchmarks/overlap_link.py``, ``docs/async.md``).

**Staggered parts** (``stagger=F``, DiLoCo; Streaming DiLoCo's schedule): rounds of ``H / F`` steps, push ``i``
carries part ``i mod F`` (:func:`~.messages.stagger_parts`), so each part syncs every ``H`` steps at its own offset
and each exchange is ``1 / F`` of the bytes. The merge applies to the part that travelled (and the buffers); the
goodbye carries every part's steps since its last exchange, which is why a staggered run needs ``τ >= 1``.
"""

from __future__ import annotations

from torch import Tensor

from lightning_hdet._checks import check_int
from lightning_hdet.asynchronous.wire.codecs import Codec


def overlap_this_round(overlap_steps: int, allocated: int, carried: int) -> int:
    """How many of a round's ``allocated`` steps come after its push: at most the round, and few enough that the
    push carries a step (``carried``: the previous round's overlapped steps; a push without steps reads as
    discarded)."""
    return max(0, min(overlap_steps, allocated, carried + allocated - 1))


def correction(global_new: Tensor, at_send: Tensor) -> Tensor:
    """``global_new − at_send``, into ``at_send`` (no temporary): added to the model it gives the merge above."""
    return at_send.neg_().add_(global_new)


def check_overlap_steps(overlap_steps: int, local_steps: int, ranks_per_worker: int, stagger: int = 1) -> None:
    """``overlap_steps``: 0 or ``1..local_steps / stagger − 1``; not with workers of several ranks."""
    check_int("overlap_steps", overlap_steps, minimum=0,
              hint="0 is a blocking exchange; τ > 0 inner steps are taken while a round's push and pull travel.")
    round_steps = local_steps // stagger
    if overlap_steps and overlap_steps >= round_steps:
        rounds = f"local_steps={local_steps}" + (f" / stagger={stagger}" if stagger > 1 else "")
        raise ValueError(f"`overlap_steps={overlap_steps}` leaves no step of a round before its push ({rounds});"
                         f" allowed: 0 (a blocking exchange) or 1..{round_steps - 1}.")
    if overlap_steps and ranks_per_worker > 1:
        raise ValueError(f"`overlap_steps={overlap_steps}` is not supported with `ranks_per_worker={ranks_per_worker}`:"
                         " a worker of several ranks hands its reply on with collectives of its own group, which"
                         " cannot run beside its training. Use overlap_steps=0, or ranks_per_worker=1.")


def check_stagger_exchange(stagger: int, pull_compression: Codec, overlap_steps: int) -> None:
    """What ``stagger > 1`` is not built for: a blocking exchange and pulls of changes (of the whole model)."""
    if stagger > 1 and not overlap_steps:
        # blocking, the goodbye carries no steps and the other parts' last steps would be lost
        raise ValueError(f"`stagger={stagger}` needs `overlap_steps` >= 1, got overlap_steps=0: a staggered run"
                         " ends with overlapped steps that carry every part's last steps. Give overlap_steps, or"
                         " use stagger=1.")
    if stagger > 1 and pull_compression.sends_changes:
        raise ValueError(f"`stagger={stagger}` is not supported with `pull_compression={pull_compression!r}`, whose"
                         " pulls carry changes of the whole model. Use pull_compression='none' or 'bf16', or"
                         " stagger=1.")
