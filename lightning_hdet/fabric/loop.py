"""HDETLoop: the votes of a Fabric training loop, which has no callbacks (the Trainer's HDETCallback's role).

The loop calls :meth:`HDETLoop.step` after every ``optimizer.step()``; every ``every_n_steps`` steps the groups
vote, exactly as under the Trainer: the same :class:`~lightning_hdet.hdet.execution.meter.IntervalMeter` (this rank's
loss curve on the device, one small all-reduce per vote), the same vote (:mod:`~lightning_hdet.hdet.lightning.voting`:
the pure :class:`~lightning_hdet.hdet.rules.controller.HDETController` deciding, the strategy's objects executing the
decision, ``strategy.hdet``, :class:`~lightning_hdet.hdet.execution.executor.HDETParts`) and the same metrics.
:meth:`HDETLoop.finish` leaves every rank holding the merged model. It is a stateful object for
``fabric.save``/``fabric.load`` (the vote rule, history, counters and multipliers).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.fabric import Fabric
from torch import Tensor

from lightning_hdet._checks import KnownArguments, check_int
from lightning_hdet.fabric.hdet import HDETFabricStrategy
from lightning_hdet.hdet.execution.meter import IntervalMeter
from lightning_hdet.hdet.lightning.voting import decide_and_execute, finish, search_end, vote_metrics
from lightning_hdet.hdet.rules.config import resolve
from lightning_hdet.hdet.rules.controller import Decision, HDETController
from lightning_hdet.hdet.rules.defaults import DEFAULT_SEARCH, DEFAULT_VOTE, vote_interval
from lightning_hdet.hdet.rules.options import SafetyNet, Search, Vote
from lightning_hdet.records.wandb import log_vote_history


class HDETLoop(KnownArguments):
    """Votes, merges and the safety net for a Fabric loop on ``Fabric(strategy="hdet")``.

    Args:
        fabric: the launched :class:`~lightning.fabric.Fabric`, after ``fabric.setup(model, optimizer)``.
        every_n_steps: steps between votes, as for :class:`~lightning_hdet.hdet.lightning.callback.HDETCallback`;
            ``None``: sized to ``max_steps`` as the Trainer sizes it (two votes in the search, 5 to 100 steps apart;
            100 without ``max_steps``).
        vote: the vote rule (``PBT(...)``, ``Softmax(...)``, ``Best(...)`` or a name), as for HDETCallback;
            ``None``: the strategy's preset's (as the Trainer installs: ``PBT()``, the published preset's
            ``Softmax()``). The votes compare each group's training loss (what :meth:`step` receives); the
            Trainer's ``monitor`` and research ``signal`` need its validation loop and do not exist here.
        search: as for HDETCallback (``None``: the preset's, ``Search()`` for the recommended): ``Search()`` ends
            a quarter into ``max_steps`` (without ``max_steps`` it searches the whole run, as a Trainer run of
            unknown length), ``Search(steps=N)`` at step ``N``; ``False``: vote the whole run.
        safety_net: ``True``, ``False`` or ``SafetyNet(...)``, as for HDETCallback.
        warmup_steps: votes before this step only merge, as for HDETCallback.
        seed: seed of the votes' random draws, as for HDETCallback.
        max_steps: the optimizer steps the loop will take (``None``: not known), for ``Search()``'s end.

    Example::

        hdet = HDETLoop(fabric, every_n_steps=50, max_steps=len(loader))  # the search ends a quarter in
        for batch in loader:
            loss = model(batch)
            fabric.backward(loss)
            optimizer.step()  # this group's learning rate
            optimizer.zero_grad()
            hdet.step(loss)  # a vote every 50 steps (a collective: every rank calls it)
        hdet.finish()  # every rank holds the merged model
    """

    def __init__(self, fabric: Fabric, every_n_steps: Optional[int] = None, vote: Union[str, Vote, None] = None,
                 search: Union[bool, Search, None] = None, safety_net: Union[bool, SafetyNet] = True,
                 warmup_steps: int = 0, seed: int = 0, max_steps: Optional[int] = None) -> None:
        strategy = fabric.strategy
        if not isinstance(strategy, HDETFabricStrategy):
            raise TypeError(f"HDETLoop needs `Fabric(strategy='hdet')` (an HDETFabricStrategy), got "
                            f"{type(strategy).__name__}.")
        if not strategy.optimizers:
            raise ValueError("HDETLoop starts from the set-up model and optimizer: call "
                             "`fabric.setup(model, optimizer)` before creating it.")
        preset = {"vote": DEFAULT_VOTE, "search": DEFAULT_SEARCH, **strategy.preset.callback}  # the Trainer's too
        vote = preset["vote"] if vote is None else vote
        search = preset["search"] if search is None else search
        check_int("max_steps", max_steps, minimum=1, optional=True)
        every_n_steps = vote_interval(max_steps) if every_n_steps is None else every_n_steps
        self.settings = resolve(every_n_steps, vote, search, safety_net, None, "mean", warmup_steps, seed)
        self.settings.vote.check_strategy(strategy.hdet.gradient_sync, list(strategy.hdet.explored.tables))
        self.fabric, self.strategy, self.hdet = fabric, strategy, strategy.hdet
        self.controller = HDETController(self.settings)
        self.controller.search_phase.steps = _search_end(self.settings.search, max_steps)
        self.global_step = 0  # optimizer steps taken (counted by `step`)
        self._last_vote_step = -1
        self._meter = IntervalMeter(self.settings.every_n_steps, self.settings.signal.bins, strategy.root_device)
        self._fresh = True  # the run's first step is ahead (not resumed): its loss is the safety net's start level
        self.controller.initial_lrs = self.hdet.table.current_lrs()[:, 0].tolist()
        self.hdet.merger.ensure_restore_point(keep_initial=self.controller.keeps_initial)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per vote and group: step, group, new LR, loss, weight, winner, rescued, reason, trained LR."""
        return self.controller.history

    @property
    def initial_lrs(self) -> list[float]:
        """Every group's real learning rate (first param group) when training started."""
        return self.controller.initial_lrs

    def step(self, loss: Tensor) -> Optional[Decision]:
        """Count one optimizer step and its loss (kept on the device); vote when ``every_n_steps`` have passed.

        Call on every rank after each ``optimizer.step()``. Returns the vote's decision, or ``None``.
        """
        self.global_step += 1
        self._meter.add(self.global_step, loss.detach(), first=self._fresh and self.global_step == 1)
        if self.global_step % self.settings.every_n_steps:
            return None
        return self._vote(final=False)

    def finish(self) -> None:
        """End the run: vote on the last interval (weigh, merge fully, leave the LRs alone) so every rank holds
        the merged model, and write the vote history (``vote_history.csv`` beside each logger's files)."""
        finish(self.hdet, self.controller, self.global_step == self._last_vote_step, lambda: self._vote(final=True))
        if self.fabric.is_global_zero and self.history:
            log_vote_history(self.fabric.loggers, self.history, step=self.global_step)

    def _vote(self, final: bool) -> Decision:
        """One vote: the groups' loss curves (one all-reduce) -> the controller's decision -> the strategy's merge."""
        hdet, step = self.hdet, self.global_step
        table = hdet.groups.gather_group_values(self._meter.row(hdet.guard.interval_skipped(reset=True)))
        reading = self._meter.read(table, monitor=False)
        if not reading.counted:
            raise ValueError(f"HDETLoop counted no training loss up to step {step}: pass each step's loss to `step`.")
        decision = decide_and_execute(hdet, self.controller, step, reading, final)
        self._last_vote_step = step
        self._meter.reset(step)
        self.fabric.log_dict(vote_metrics(decision, self.controller.rescues), step=step)
        return decision

    # ------------------------------------------------------------------ fabric.save / fabric.load
    def state_dict(self) -> dict[str, Any]:
        """The vote's state, the step count and the multipliers, the LR's and the other explored hyperparameters'
        (the interval in progress starts afresh on load)."""
        return {**self.controller.state_dict(), "last_vote_step": self._last_vote_step,
                "global_step": self.global_step, "lr_multipliers": self.hdet.table.multipliers,
                "explored": self.hdet.explored.tables}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
        self._last_vote_step = state["last_vote_step"]
        self.global_step = state["global_step"]
        self.hdet.table.set(state["lr_multipliers"])
        if "explored" in state:
            self.hdet.set_explored(state["explored"])
        self._fresh = False
        self._meter.reset(self.global_step)


def _search_end(search: Optional[Search], max_steps: Optional[int]) -> Optional[int]:
    """The step the search may end at (:func:`~lightning_hdet.hdet.lightning.voting.search_end`): ``Search(steps=N)``'s,
    else a quarter of ``max_steps``."""
    return search_end(search, max_steps, "HDET: HDETLoop does not know the run's length (no max_steps): the search "
                      "runs the whole run; give HDETLoop(max_steps=...) or search=Search(steps=...) to end it.")
