"""Overlapping the exchange with compute: the round's schedule and the correction at the merge. Pure: no Lightning,
no process groups.

With ``overlap_steps=τ`` a worker sends its round's pseudo-gradient ``τ`` inner steps before its round ends and
keeps training while the push and the pull travel; after those ``τ`` steps it merges the pulled global model:

    θ ← θ_global_new + (θ_local_now − θ_local_at_send)

and ``θ_global_new`` is the reference of its next pseudo-gradient, so that push carries the ``τ`` overlapped steps
plus the steps after the merge.

Why this correction, and not Streaming DiLoCo's mix ``α θ_local_now + (1 − α) θ_global_new`` (Douillard et al.,
arXiv 2501.18512; its reference is also ``θ_global_new``):

* **No step is lost or counted twice.** The ``τ`` steps' displacement ``θ_local_now − θ_local_at_send`` moves onto
  the new global model whole and goes into the next push whole, so every inner step reaches the outer optimizer
  exactly once, which keeps ``max_steps`` an exact budget. The mix keeps only ``α`` of it (and ``α`` of the
  worker's drift ``θ_local_at_send − θ_global_new``, which the outer step has already averaged away): with
  ``α = 0.5`` half of the overlapped compute is thrown away.
* **``τ = 0`` is the blocking exchange, bit for bit**: the displacement is zero and the worker restarts from the
  global model, as without overlap; no second knob (``α``) to tune per run.
* **First-order, it is the blocking worker's round.** The overlapped steps computed their gradients at
  ``θ_local_at_send + …`` instead of ``θ_global_new + …``; the displacement differs from the one the blocking
  worker would have taken by ``O(lr · τ · ‖∇²L‖ · ‖θ_local_at_send − θ_global_new‖)``, the same kind of delay
  that asynchronous pushes already carry, and what "eager updates" (Kale et al., arXiv 2502.12996) rely on when
  they apply local progress before the global one arrives. That gap is not small when the outer step is
  conservative (the default outer lr, 0.375 since issue 60, 0.163 before, moves the global model a third of the way
  to the workers' mean before momentum): the overlapped steps then start further along than the global model, where the
  gradients differ; measured (at 0.339), the loss at a fixed budget grows with ``τ / H``
  (``benchmarks/overlap_link.py``, ``docs/async.md``).

**Staggered parts** (``stagger=F``, DiLoCo; Streaming DiLoCo's schedule, arXiv 2501.18512): the model's fragments
are grouped into ``F`` parts of consecutive fragments (:func:`~.messages.stagger_parts`), rounds are ``H / F`` steps
and push ``i`` carries part ``i mod F`` only, so each part is synchronised every ``H`` steps, at its own offset, and
each exchange is ``1 / F`` of the bytes: ``τ`` can be ``F`` times smaller for the same hidden link time. The merge
above applies to the part that travelled (and the buffers); the other parts train on. The goodbye carries every
part's steps since its last exchange (which is why a staggered run needs ``τ >= 1``: its goodbye always has steps).

The cost: the worker keeps ``θ_local_at_send`` while the exchange travels (one model-sized host copy; rank 0's
worker keeps it in its pulled model's buffer instead, see :mod:`.overlapped`).
"""

from __future__ import annotations

from torch import Tensor

from lightning_hdet._checks import check_int
from lightning_hdet.asynchronous.wire.codecs import Codec


def overlap_this_round(overlap_steps: int, allocated: int, carried: int) -> int:
    """How many of a round's ``allocated`` steps come after its push: ``overlap_steps``, but at most the round, and
    few enough that the push carries at least one step (``carried``: overlapped steps of the previous round, already
    in the model since its reference; a push without steps would read as a discarded round)."""
    return max(0, min(overlap_steps, allocated, carried + allocated - 1))


def correction(global_new: Tensor, at_send: Tensor) -> Tensor:
    """``global_new − at_send``, written into ``at_send`` (no temporary): added to the worker's current model it gives
    ``global_new + (local_now − at_send)``, the merge above."""
    return at_send.neg_().add_(global_new)


def check_overlap_steps(overlap_steps: int, local_steps: int, ranks_per_worker: int, stagger: int = 1) -> None:
    """``overlap_steps``: 0 (a blocking exchange) or ``1..local_steps / stagger − 1`` (a round); not with workers of
    several ranks."""
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
    """What ``stagger > 1`` is not built for: a blocking exchange (and so, see :func:`check_overlap_steps`, workers
    of several ranks) and pulls of the public model's changes (they carry the whole model)."""
    if stagger > 1 and not overlap_steps:
        # the goodbye carries every part's steps since its last exchange only when it carries steps at all: with
        # τ >= 1 it always does (the τ steps after the last push); blocking, it carries none and the other parts'
        # last steps would be lost
        raise ValueError(f"`stagger={stagger}` needs `overlap_steps` >= 1, got overlap_steps=0: a staggered run"
                         " ends with overlapped steps that carry every part's last steps. Give overlap_steps, or"
                         " use stagger=1.")
    if stagger > 1 and pull_compression.sends_changes:
        raise ValueError(f"`stagger={stagger}` is not supported with `pull_compression={pull_compression!r}`, whose"
                         " pulls carry changes of the whole model. Use pull_compression='none' or 'bf16', or"
                         " stagger=1.")
