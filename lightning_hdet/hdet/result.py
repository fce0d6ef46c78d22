"""What HDET hands back: :class:`HDETResult` at the end of ``fit`` (``HDETCallback.result``), its one-paragraph
summary, and the one short line each vote logs (pure: no Lightning, no process group).

Ray Tune returns a result with the best configuration; HDET's counterpart is the learning rates the run ended
on, which vote picked which group, how often the safety net stepped in and where the full vote table went.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_hdet.hdet.console import rounded, rounded_list


@dataclass(frozen=True)
class HDETResult:
    """What an HDET run found (every rank holds the same; rank 0 logs its :meth:`summary`).

    Attributes:
        lrs: the learning rate of each optimizer param group that the last vote's winner ended ``fit`` with (the
            schedule's LR at the end times the winner's multiplier): where to continue from.
        group_lrs: every group's real learning rates at the end, ``[group][param group]``.
        initial_lrs: every group's first-param-group learning rate when training started.
        winners: ``(step, group)`` of every vote, in order (group ``-1``: no group was healthy).
        votes: the votes counted (a final merge that moved nothing is not one).
        rescues: groups the safety net restored (a roll-back counts every diverged group).
        searched_at: the step of the vote that ended the search (``search_steps``), ``None`` if none did.
        vote_history: where the per-group vote table went (``vote_history.csv`` paths, the W&B table's key).
        history: that table's rows (one per vote and group, the columns of ``vote_history.csv``): :meth:`to_rows`.
        steps: the optimizer steps the run took (``None``: not known).
        every_n_steps: the interval between votes (``None``: not known).
        gradient_sync: how gradients were averaged at the end (``"group"``, ``"cluster"`` or ``"global"``; ``None``:
            not known).
        ties: votes on a monitored metric that every group reported alike while their parameters differed
            (:mod:`~lightning_hdet.hdet.lightning.monitor`).
        restarted_at: the step at which the search's end restarted every group from the initial model
            (``Search.restart_below``: the LR it found was far below the starting one), ``None`` if it did not.
        ladders: the steps at which the plateau rule rolled every group back onto its ladder of 10-100x lower LRs
            (``PlateauRule``: no new best for its patience, in a run that had failed before).
        monitor: the metric the votes read (``None``: each group's training loss); ``monitor="auto"`` decides it.
        edges: per vote, where its winner stood among the LRs voted on: ``1`` the highest, ``-1`` the lowest, ``0``
            inside. An edge that won the last votes says the best LR lies beyond what was tried.
        unclear: the votes whose winner led the runner-up by less than two standard errors (within noise).
        judged: the votes whose lead could be judged that way (training-loss votes with loss curves).
    """

    lrs: list[float]
    group_lrs: list[list[float]]
    initial_lrs: list[float]
    winners: list[tuple[int, int]]
    votes: int
    rescues: int
    searched_at: Optional[int]
    vote_history: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)
    steps: Optional[int] = None
    every_n_steps: Optional[int] = None
    gradient_sync: Optional[str] = None
    ties: int = 0
    restarted_at: Optional[int] = None
    ladders: list[int] = field(default_factory=list)
    monitor: Optional[str] = None
    edges: list[int] = field(default_factory=list)
    unclear: int = 0
    judged: int = 0

    def summary(self) -> str:
        """The run in a few lines, numbers rounded; without a vote, what the run then was."""
        winner = self.winners[-1][1] if self.winners else -1
        tally = ", ".join(f"group {g} x{n}" if g >= 0 else f"no healthy group x{n}"
                          for g, n in sorted(Counter(g for _, g in self.winners).items()))
        found = "LRs found" if self.votes else "LRs at the end, never moved"
        lines = [
            f"HDET result: {self.votes} vote(s), {self.rescues} rescue(s)"
            + (f", search ended at step {self.searched_at}" if self.searched_at is not None else "")
            + (" and restarted every group from the initial model" if self.restarted_at is not None else ""),
            *([] if self.votes else [self._no_vote()]),
            f"  {found} (per param group{', group ' + str(winner) if winner >= 0 else ''}): "
            f"{rounded_list(self.lrs)}; every group started at {rounded_list(self.initial_lrs)}",
            f"  winners: {tally or 'none'}; the votes read "
            + (f"each group's `{self.monitor}`" if self.monitor else "each group's training loss"),
            *self.advice(),
            *([self._ladders()] if self.ladders else []),
            *([f"  {self.ties} vote(s) saw one monitored value for every group although their parameters differed: "
               "the metric was not each group's own (see the warnings)"] if self.ties else []),
            f"  vote history: {', '.join(self.vote_history) or 'not written (no logger with a log_dir)'}",
        ]
        return "\n".join(lines)

    def edge_run(self) -> int:
        """``1`` (``-1``) when the highest (lowest) LR voted on won the last two votes or more, else ``0``."""
        last = self.edges[-2:]
        return last[0] if len(last) == 2 and last[0] == last[1] != 0 else 0

    def advice(self) -> list[str]:
        """What to do next, in lines: where the best LR likely lies, whether the votes could tell the LRs apart, and
        the LR for a plain run."""
        if not self.votes or not self.lrs:
            return []
        lines = []
        top = max(lr[0] for lr in self.group_lrs) if self.group_lrs else self.lrs[0]
        low = min(lr[0] for lr in self.group_lrs) if self.group_lrs else self.lrs[0]
        edge = self.edge_run()
        if edge:
            side, bound = ("highest", top) if edge > 0 else ("lowest", low)
            lines.append(f"  the {side} LR tried won the last votes: your best LR is likely "
                         f"{'above' if edge > 0 else 'below'} {rounded(bound)}. Train longer with HDET (the grid moves "
                         f"on that way at every vote), or start the next run from there.")
        if self.judged and 2 * self.unclear >= self.judged:
            lines.append(f"  {self.unclear} of {self.judged} votes were within noise (the winner led by under two "
                         "standard errors): the LRs tried trained about equally well, so the one found is no better "
                         "established than its neighbours. More steps per vote (every_n_steps) would tell them apart.")
        lead = self._last_lead() if self.monitor and not self.judged else None
        if lead is not None:  # a monitored value comes without a standard error: the margin, for the user to judge
            lines.append(f"  the votes read one `{self.monitor}` per group, with no standard error to tell noise by: "
                         f"the last vote's winner led the next group by {lead:.2g} % of its value.")
        if self.votes < 3:
            lines.append(f"  only {self.votes} vote(s): too few to search; train longer or vote more often.")
        lines.append(f"  for a plain run (one LR, e.g. DDP) use lr={rounded_list(self.lrs)} "
                     "(per param group: the LR the last winner ended at).")
        return lines

    def _last_lead(self) -> Optional[float]:
        """How far the last vote's winner led the next healthy group, in % of its loss (``None``: no such pair)."""
        step, winner = self.winners[-1] if self.winners else (None, -1)
        rows = [r for r in self.history if r["step"] == step and not r["rescued"] and math.isfinite(r["loss"])]
        won = [r["loss"] for r in rows if r["group"] == winner]
        others = [r["loss"] for r in rows if r["group"] != winner]
        if not won or not others or won[0] == 0:
            return None
        return 100 * (min(others) - won[0]) / abs(won[0])

    def _ladders(self) -> str:
        """The plateau rule's interventions: every LR moved far down, which a slow start can trigger too."""
        steps = ", ".join(str(step) for step in self.ladders)
        return (f"  the plateau rule moved every group onto 10-100x lower LRs at step(s) {steps}: no group set a new "
                "best after a failure. A model that sits at its untrained loss for a while at any LR (a CNN's start) "
                "looks the same; if the LRs found are far below a good one, see docs/hdet.md, 'Safety net'.")

    def _no_vote(self) -> str:
        """What a run without a vote was: every group at its starting LR, merged (if at all) at the end."""
        steps = "the run" if self.steps is None else f"{self.steps} step(s)"
        every = "" if self.every_n_steps is None else f" (a vote every {self.every_n_steps} steps)"
        shared = {"global": "plain DDP on one shared gradient, each group stepping at its starting LR",
                  "group": "one plain DDP run per group, each at its starting LR",
                  "cluster": "one plain DDP run per cluster of groups, each at its starting LR"}.get(self.gradient_sync or "",
                                                                                       "each group at its starting LR")
        merged = f"; the final merge at step {self.winners[-1][0]} combined them" if self.winners else ""
        return (f"  no vote in {steps}{every}: no LR moved, so the run was {shared} "
                f"({rounded_list(self.initial_lrs)}){merged}. Nothing was searched: vote more often "
                "(HDETCallback(every_n_steps=...)) or train longer.")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python values (lists, dicts, numbers, strings), e.g. for ``json.dump``; ``winners``
        as ``{"step", "group"}`` dicts."""
        plain = asdict(self)
        plain["winners"] = [{"step": step, "group": group} for step, group in self.winners]
        return plain

    def to_rows(self) -> list[dict[str, Any]]:
        """The vote table: one dict per vote and group (``step, group, lr, loss, weight, winner, rescued,
        trained_lr`` and the explored hyperparameters' columns, as ``vote_history.csv``), ready for
        ``csv.DictWriter`` or ``pandas.DataFrame``.

        ``loss`` is what the group reached from ``trained_lr``, its LR at the interval's first step (what the vote
        before set, the initial LR at the first vote; a scheduler moves it within the interval); ``lr`` is the LR
        this vote set, from this vote on (what ``HDETReplay`` replays); both of the first param group. Each explored
        hyperparameter likewise: ``<name>`` the value set, ``trained_<name>`` the one trained at. Rows from a
        checkpoint older than ``trained_lr`` get the vote before's ``lr`` (NaN at the first vote)."""
        return [dict(row) for row in self.history]


def make_result(
    history: Sequence[Mapping[str, Any]],
    group_lrs: Sequence[Sequence[float]],
    initial_lrs: Sequence[float],
    votes: int,
    rescues: int,
    searched_at: Optional[int],
    vote_history: Sequence[str],
    table: Optional[Sequence[Mapping[str, Any]]] = None,
    **run: Any,
) -> HDETResult:
    """The result from the controller's history rows (one per vote and group, with ``step`` and ``winner``, and
    where kept ``reason``, ``edge`` and ``clear``) and the end-of-fit LR table; ``table``: the rows as the vote
    history table holds them (default: ``history``); ``run``: the other fields (``steps``, ``every_n_steps``,
    ``gradient_sync``, ``ties``, ``restarted_at``, ``monitor``)."""
    winners: list[tuple[int, int]] = []
    firsts: list[Mapping[str, Any]] = []  # each vote's first row: the vote-wide columns
    for row in history:
        if not winners or winners[-1][0] != row["step"]:
            winners.append((int(row["step"]), int(row["winner"])))
            firsts.append(row)
    lr_table = [[float(lr) for lr in row] for row in group_lrs]
    last = winners[-1][1] if winners else -1
    if last >= 0:
        lrs = lr_table[last]
    else:  # no vote or no healthy winner: the groups' mean
        lrs = [sum(column) / len(column) for column in zip(*lr_table)] if lr_table else []
    ladders = sorted({int(row["step"]) for row in history if row.get("reason") == "plateau"})
    clear = [row["clear"] for row in firsts if row.get("clear", "") != ""]
    rows = history if table is None else table
    return HDETResult(lrs, lr_table, [float(x) for x in initial_lrs], winners, votes, rescues, searched_at,
                      list(vote_history), [dict(row) for row in rows], ladders=ladders,
                      edges=[int(row.get("edge", 0)) for row in firsts], unclear=sum(not c for c in clear),
                      judged=len(clear), **run)


def vote_line(step: int, winner: int, losses: Sequence[float], lrs: Sequence[float], final: bool = False) -> str:
    """One vote in one short line: ``HDET: vote at step 200: group 2 won (loss 0.4123); losses [...]; LRs now [...]``
    (the LRs the vote set, not those that reached the losses)."""
    head = f"HDET: {'final merge' if final else 'vote'} at step {step}: "
    won = f"group {winner} won (loss {rounded(losses[winner])})" if winner >= 0 else "no group was healthy"
    return f"{head}{won}; losses {rounded_list(losses)}; LRs now {rounded_list(lrs)}"


def failed_groups(rescued: Sequence[bool], reasons: Sequence[str]) -> str:
    """The rescued groups, each reason said once: ``groups 0, 2 (x best) and group 1 (non-finite)``."""
    by_reason: dict[str, list[int]] = {}
    for g, flag in enumerate(rescued):
        if flag:
            by_reason.setdefault(reasons[g] if g < len(reasons) else "", []).append(g)
    parts = [f"group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}" + (f" ({why})" if why else "")
             for why, groups in by_reason.items()]
    return " and ".join(parts)
