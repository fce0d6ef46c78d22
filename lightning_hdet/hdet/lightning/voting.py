"""One vote, shared by the Trainer's :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback` and Fabric's
:class:`~lightning_hdet.fabric.loop.HDETLoop` (no Trainer here: each brings its own readings and loggers).

A vote: the groups' :class:`~lightning_hdet.hdet.execution.meter.Reading` -> :func:`decide_and_execute` (the pure
:class:`~lightning_hdet.hdet.rules.controller.HDETController` decides, the strategy's parts, ``strategy.hdet``, carry
the decision out) -> :func:`vote_metrics` for the loggers. :func:`finish` is the end of a run; :func:`search_end` where
``Search()`` may end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hdet.hdet.clusters import after_vote
from lightning_hdet.hdet.console import rounded_list
from lightning_hdet.hdet.execution.meter import Reading
from lightning_hdet.hdet.hyperparams import metrics as explored_metrics
from lightning_hdet.hdet.result import failed_groups, vote_line
from lightning_hdet.hdet.rules.controller import Decision, HDETController, Interval
from lightning_hdet.hdet.rules.defaults import SEARCH_FRACTION
from lightning_hdet.hdet.rules.options import Search

if TYPE_CHECKING:
    from lightning_hdet.hdet.execution.executor import HDETParts


def decide_and_execute(
    hdet: HDETParts, controller: HDETController, step: int, reading: Reading, final: bool
) -> Decision:
    """The controller's decision on this interval's ``reading`` (the search may end here unless ``final``),
    carried out by the strategy (:func:`execute`)."""
    decision = controller.decide(Interval(
        step=step, losses=reading.losses, finite=reading.finite, multipliers=hdet.table.multipliers,
        schedule_lrs=hdet.table.schedule_lrs().tolist(), shared_gradients=hdet.gradient_sync == "global",
        final=final, curves=reading.curves, first_losses=reading.first_losses, first_errors=reading.first_errors,
        refine=not final and controller.search_ends(step), explored=hdet.explored,
        holds_initial=hdet.merger.initial_point is not None,
    ))
    execute(hdet, decision)
    return decision


def execute(hdet: HDETParts, decision: Decision) -> None:
    """The strategy carries out one decision: roll back, or merge (one collective per step of the plan); then the
    new multipliers, the clusters they and the merge leave (``gradient_sync="cluster"``) and, when the decision ended
    the search, gradients averaged over all ranks."""
    if decision.roll_back:
        hdet.merger.restore(decision.from_initial)
        rank_zero_info(f"HDET: step {decision.step}: {failed_groups(decision.rescued, decision.reasons)} diverged;"
                       " every group rolled back to the last good merged model.")
    elif hdet.num_groups > 1:
        for step in decision.plan:  # one collective each: one blend, or one copy per PBT source
            hdet.merger.merge(step.coefficients, step.strengths, restart=decision.restart, keep=decision.keep)
        if any(decision.from_initial) and not decision.refined:  # probes below a too-high grid (Ballot.direction)
            hdet.merger.restart_groups(decision.from_initial)
    hdet.table.set(decision.multipliers)
    if decision.explored:
        hdet.set_explored(decision.explored)
    if hdet.gradient_sync == "cluster" and not decision.refined:  # (the search's end: every rank, below)
        hdet.set_clusters(after_vote(hdet.clusters, hdet.rate_rows(), decision))
    if decision.refined:
        hdet.set_gradient_sync("global")
        restarted = any(decision.from_initial) and hdet.merger.restart_from_initial()
        start = "the initial model (Search.restart_below)" if restarted else "its model"
        rank_zero_info(f"HDET: step {decision.step}: search ended on group {decision.winner}; every group trains "
                       f"from {start} at LRs {rounded_list(decision.lrs)} with gradient_sync='global'.")
    if decision.warning:
        rank_zero_warn(decision.warning)


def finish(hdet: HDETParts, controller: HDETController, voted_last: bool, vote_final: Callable[[], object]) -> None:
    """End the run so every rank holds the merged model: with nothing trained since the last vote
    (``voted_last``), that vote's merge at full strength; else ``vote_final()``, a vote on the last interval."""
    if hdet.num_groups == 1:
        return
    if voted_last:
        coefficients, strengths = controller.finishing_merge()
        hdet.merger.merge(coefficients, strengths, restart=[False] * hdet.num_groups)
    else:
        vote_final()


def vote_metrics(decision: Decision, rescues: int) -> dict[str, float]:
    """What a vote logs at its own step: winner, rescues, every group's loss, weight and new LR, the groups' mean
    LR and the other explored hyperparameters."""
    metrics: dict[str, float] = {"hdet/vote/winner": float(decision.winner), "hdet/rescues": float(rescues)}
    for g, (loss, weight, lr) in enumerate(zip(decision.losses, decision.weights, decision.lrs)):
        metrics.update({f"hdet/group{g}/loss": loss, f"hdet/vote/weight{g}": weight, f"hdet/group{g}/lr": lr})
    metrics["hdet/mean_lr"] = sum(decision.lrs) / len(decision.lrs)
    return {**metrics, **explored_metrics(decision.values)}


def announce(decision: Decision, rescues: int, final: bool) -> None:
    """The vote's console line (rank 0), and one for the groups it rescued."""
    rank_zero_info(vote_line(decision.step, decision.winner, decision.losses, decision.lrs, final))
    if any(decision.rescued):
        rank_zero_info(f"HDET: step {decision.step}: rescued {failed_groups(decision.rescued, decision.reasons)};"
                       f" losses {rounded_list(decision.losses)}; total rescues {rescues}")


def default_search_step(total: int) -> int:
    """Where ``Search()`` may end in a run of ``total`` optimizer steps."""
    return int(total * SEARCH_FRACTION)


def search_end(search: Optional[Search], total: Optional[int], unknown: str) -> Optional[int]:
    """The step at which ``search`` may end: its own ``steps``, else ``SEARCH_FRACTION`` (a quarter) of a run of
    ``total`` steps; ``None`` (no end) without a search, or without a known length (then ``unknown`` is said)."""
    if search is None or search.steps is not None:
        return None if search is None else search.steps
    if total is None:
        rank_zero_info(unknown)
        return None
    return default_search_step(total)
