"""HDETCallback: every T steps the groups vote on their losses, learning rates move, parameters are blended.

The callback decides and the strategy executes. One vote, top to bottom (:meth:`HDETCallback.vote_and_merge`):

1. ``_signal``: every group's loss curve over the interval (:mod:`~lightning_hdet.hdet.execution.meter`) and whether it
   stayed finite (one small all-reduce: ``strategy.hdet.groups.gather_group_values``; the skipped-step count
   comes from the reset-on-read counter of the strategy's guard, ``strategy.hdet.guard``);
2. ``controller.decide``: the pure :class:`~lightning_hdet.hdet.rules.controller.HDETController` turns those numbers
   into a :class:`~lightning_hdet.hdet.rules.controller.Decision` (rules in :mod:`~lightning_hdet.hdet.rules.signals`,
   the rule objects of :mod:`~lightning_hdet.hdet.rules.options`: the vote's ``explore``, the safety net's ``judge``,
   the signal's ``scores``; :mod:`~lightning_hdet.hdet.rules.blends`);
3. the strategy's objects execute it: ``merger.restore()`` (roll-back) or one ``merger.merge(...)`` per step of
   the decision's plan, then ``table.set(...)``;
4. ``_log_vote``: metrics and the vote history.

Steps 2 and 3, the vote's metrics and the end of the run are :mod:`~lightning_hdet.hdet.lightning.voting`'s, shared with
Fabric's :class:`~lightning_hdet.fabric.loop.HDETLoop`.

The callback talks to the strategy only through ``strategy.hdet``
(:class:`~lightning_hdet.hdet.execution.executor.HDETParts`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_hdet._checks import KnownArguments, did_you_mean
from lightning_hdet._text import counted
from lightning_hdet.hdet.execution.executor import HDETParts, is_executor
from lightning_hdet.hdet.execution.meter import IntervalMeter, Reading
from lightning_hdet.hdet.hyperparams import Explored, values
from lightning_hdet.hdet.hyperparams import metrics as explored_metrics
from lightning_hdet.hdet.lightning import auto_monitor
from lightning_hdet.hdet.lightning.checkpoints import restore_schedule_lrs, save_plain_lrs
from lightning_hdet.hdet.lightning.module_checks import check_module, missing_loss, step_loss, stepping_warning
from lightning_hdet.hdet.lightning.monitor import FINGERPRINT_WIDTH, MonitoredMetric, validation_plan
from lightning_hdet.hdet.lightning.voting import (
    announce,
    decide_and_execute,
    default_search_step,
    finish,
    search_end,
    vote_metrics,
)
from lightning_hdet.hdet.result import HDETResult, make_result
from lightning_hdet.hdet.rules.config import HDETConfig, resolve
from lightning_hdet.hdet.rules.controller import Decision, HDETController
from lightning_hdet.hdet.rules.defaults import DEFAULT_SEARCH, DEFAULT_VOTE, MIN_INTERVAL, SEARCH_FRACTION, vote_interval
from lightning_hdet.hdet.rules.options import SafetyNet, Search, Signal, Vote
from lightning_hdet.records import History, log_report_figures
from lightning_hdet.records.wandb import (
    finish_worker_run,
    log_vote_history,
    record_config,
    vote_history_locations,
    vote_rows,
)

log = logging.getLogger(__name__)


class HDETCallback(KnownArguments, Callback):
    """Loss-based voting, learning-rate exploration, parameter blending and the safety net for HDET.

    The defaults are the measured best (:mod:`~lightning_hdet.hdet.rules.defaults`): a ``PBT`` search for the first
    quarter of the run, then training around what it found. Research options are in :mod:`lightning_hdet.experimental`.

    Args:
        every_n_steps: the interval T between votes/merges, in optimizer steps. ``None`` sizes it to the run
            (:func:`vote_plan`), on the validation's steps where the votes read a validation metric
            (:func:`~lightning_hdet.hdet.lightning.monitor.validation_plan`).
        vote: the vote rule (a name gives its defaults): :class:`~lightning_hdet.PBT` (``"pbt"``),
            :class:`~lightning_hdet.Softmax` (``"softmax"``: the published controller), :class:`~lightning_hdet.Best`
            (``"best"``) or :class:`~lightning_hdet.TrustRegion` (``"trust_region"``, ``gradient_sync="global"`` only).
        search: :class:`~lightning_hdet.Search`: when the search ends and every group trains around its winner
            (``True``: at a quarter of the run); ``False``: the vote searches the whole run (the published set-up).
        safety_net: :class:`~lightning_hdet.SafetyNet` (``True``: its defaults): skip non-finite steps, restore
            diverged or collapsed groups, and move an ensemble that stopped learning onto lower LRs; ``False``: off.
        monitor: ``"auto"``: ``"val_loss"`` where the run repeats its data and validates, else ``None``
            (:mod:`~lightning_hdet.hdet.lightning.auto_monitor`). ``None`` votes on each group's mean training loss over
            the interval; a metric name on each group's own value of that logged metric, from the first validation
            ending at or after the vote's step (:mod:`~lightning_hdet.hdet.lightning.monitor`).
        signal: what the vote compares: ``"mean"`` (the interval's loss); research signals are in
            :mod:`lightning_hdet.experimental`.
        warmup_steps: votes before this step only merge; learning rates start moving after it.
        seed: seed of the callback's own generator for the votes' random draws (never the global RNG).
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        vote: Union[str, Vote] = DEFAULT_VOTE,
        search: Union[bool, Search] = DEFAULT_SEARCH,
        safety_net: Union[bool, SafetyNet] = True,
        monitor: Optional[str] = auto_monitor.AUTO,
        signal: Union[str, Signal] = "mean",
        warmup_steps: int = 0,
        seed: int = 0,
    ) -> None:
        # "auto" is decided at train start (`_choose_monitor`); until then the votes would read the training loss.
        self._auto = monitor == auto_monitor.AUTO
        self.settings = resolve(every_n_steps, vote, search, safety_net, None if self._auto else monitor, signal,
                                warmup_steps, seed)
        self._requested_every = every_n_steps  # None: sized to the run at set-up or train start (`sized_interval`)
        self.config = auto_monitor.recorded(self.settings, self._auto)  # the run config's ``hdet/callback/...``
        self.controller = HDETController(self.settings)
        self.report = History()  # what this run logged, for the figures at the end of fit (rank 0)
        self.result: Optional[HDETResult] = None  # what the run found, set at the end of fit (every rank)
        self._last_vote_step, self._first_vote = -1, 1
        self._meter: Optional[IntervalMeter] = None  # this rank's interval, on the device (no host sync per step)
        self._first_pending = False  # the run's first optimizer step has not ended yet (fresh runs only)
        monitored = self.settings.monitor
        self._monitor = None if monitored is None else MonitoredMetric(monitored)  # value, waiting vote, ties
        self._checked_strategy: Any = None  # the strategy `_parts` last found to carry HDET's parts
        self._resumed_interval: Optional[Tensor] = None
        self._loaded: dict[str, Any] = {}  # a checkpoint's state, for the monitor "auto" picks at train start

    # Read-outs (the rules and settings live in `settings`, the vote's state in `controller`).
    @property
    def every_n_steps(self) -> Optional[int]:
        """The interval between votes (``None`` until a fit sized a default one to its run)."""
        return self.settings.every_n_steps

    @property
    def vote(self) -> str:
        """The vote rule's name (the rule itself: ``settings.vote``)."""
        return self.settings.vote.name

    @property
    def search(self) -> Optional[Search]:
        """The search (``None``: the vote runs the whole run)."""
        return self.settings.search

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per vote and group: step, group, new LR, loss, weight, winner, rescued, trained LR."""
        return self.controller.history

    @property
    def initial_lrs(self) -> list[float]:
        """Every group's real learning rate (first param group) when training started."""
        return self.controller.initial_lrs

    @property
    def rescues(self) -> int:
        return self.controller.rescues

    @property
    def num_votes(self) -> int:
        return self.controller.num_votes

    @property
    def ties(self) -> int:
        """Votes on ``monitor`` whose groups all reported one value although their parameters differed."""
        return 0 if self._monitor is None else self._monitor.ties

    # ------------------------------------------------------------------ set-up
    def _parts(self, trainer: Trainer) -> HDETParts:
        """The strategy's HDET parts (``strategy.hdet``): all the callback touches of it, but for the Trainer's own."""
        strategy = trainer.strategy
        if strategy is not self._checked_strategy:  # once, not per step
            if not is_executor(strategy):
                raise MisconfigurationException(
                    f"HDETCallback needs `Trainer(strategy='hdet')` (or an HDETStrategy), got {type(strategy).__name__}."
                )
            self._checked_strategy = strategy
        return strategy.hdet

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        hdet = self._parts(trainer)
        if stage == "fit":
            check_module(pl_module, self.settings.monitor)  # before any step: a module the votes cannot read
            self.settings.vote.check_strategy(hdet.gradient_sync, list(hdet.explored.tables))  # before the guard
            if self.settings.safety_net is not None:
                hdet.guard.enable()  # here: before the strategy wraps the model (the guard is a DDP hook)
            # Every group validates the same data wherever the votes may read a validation metric ("auto" decides
            # only at train start, after the fit built its validation data): else each group's value is its own
            # share of the validation set's.
            hdet.validate_in_groups(self._monitor is not None or (self._auto and type(self.settings.signal) is Signal))
            # A run bounded by max_steps is sized now; one bounded by epochs at train start (Lightning's estimate
            # loads the training data, which the module's own `setup` may still have to build).
            bounded = trainer.max_steps > 0
            self._set_interval(sized_interval(self._requested_every, trainer.max_steps if bounded else None, bounded))
            record_config(trainer, "hdet", {**hdet.config, "callback": self.config})
            _announce(trainer, hdet, self.settings, _search_plan(self.search, trainer))  # here: before any progress bar exists, so not inside one

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        hdet = self._parts(trainer)
        if trainer.max_steps <= 0:  # bounded by epochs (or not at all): Lightning's estimate of the run's steps
            self._set_interval(sized_interval(self._requested_every, run_length(trainer), True, announce=True), trainer)
        every = self.settings.every_n_steps
        if self._auto and self._monitor is None and type(self.settings.signal) is Signal:  # "auto" decides now
            self._set_monitor(*auto_monitor.decide(trainer, run_length(trainer), every), trainer)
        self._first_vote = every  # a sized interval moved onto validation's steps votes first here, not earlier
        if self._monitor is not None:  # votes wait for validation: on its grid, each reads a fresh value
            every = self._set_interval(on_validation_grid(self._requested_every, every, self._monitor.name,
                                                          auto_monitor.validation_period(trainer)), trainer)
        if self._meter is None:
            self._meter = IntervalMeter(every, self.settings.signal.bins, hdet.groups.root_device)
        self._meter.reset((trainer.global_step // every) * every)  # votes fall on multiples of every_n_steps
        resumed = self._resumed_interval
        if resumed is not None and resumed.shape[1] == self._meter.width:  # another signal's bins: a fresh interval
            self._meter.load_row(resumed[hdet.groups.group_index] / hdet.groups.layout.group_size)
        self._resumed_interval = None
        self._first_pending = trainer.ckpt_path is None and trainer.global_step == 0
        if trainer.ckpt_path is None or len(self.controller.initial_lrs) != hdet.num_groups:  # (resumed: the ckpt's)
            self.controller.initial_lrs = hdet.table.current_lrs()[:, 0].tolist()
        stepping = stepping_warning(pl_module, len(trainer.optimizers), every)  # (the optimizers exist only now)
        if stepping is not None:
            rank_zero_warn(stepping)
        hdet.merger.ensure_restore_point(keep_initial=self.controller.keeps_initial)
        if self.controller.searched_at is not None:
            hdet.set_gradient_sync("global")  # resumed after the search ended
        self.controller.search_phase.steps = search_steps(self.search, trainer)
        self.controller.run_steps = run_length(trainer)
        if self.controller.searched_at is not None:
            rank_zero_info(f"HDET: resumed after the search ended at step {self.controller.searched_at}")

    def _set_monitor(self, name: Optional[str], line: str = "", trainer: Optional[Trainer] = None) -> None:
        """Vote on ``name`` from now on (``None``: the training loss); with ``trainer``, say why (``line``)."""
        self.settings = replace(self.settings, monitor=name)
        self.controller.config = self.settings
        self.config = auto_monitor.recorded(self.settings, self._auto)
        self._monitor = None if name is None else MonitoredMetric(name)
        if self._monitor is not None:
            self._monitor.load_state_dict(self._loaded)  # (a resume's: "auto" decides after the callback loaded)
        if trainer is not None or line:
            auto_monitor.announce(trainer, trainer and self._parts(trainer), name, line, self.config)

    def _set_interval(self, every: Optional[int], trainer: Optional[Trainer] = None) -> Optional[int]:
        """Vote every ``every`` steps (``None``: sized at train start); with ``trainer``, a run config that showed
        another interval shows this one."""
        moved = every != self.settings.every_n_steps
        self.settings = replace(self.settings, every_n_steps=every)
        self.controller.config = self.settings  # (its plateau patience and curve signals read the interval)
        self.config = auto_monitor.recorded(self.settings, self._auto)
        if trainer is not None and moved:
            record_config(trainer, "hdet", {**self._parts(trainer).config, "callback": self.config})
        return every

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        hdet = self._parts(trainer)
        loss = step_loss(outputs, pl_module, trainer.accumulate_grad_batches)
        if loss is not None:
            self._meter.add(trainer.global_step, loss, first=self._first_pending)
        elif self._first_pending and self._monitor is None and not pl_module.automatic_optimization:
            raise missing_loss(pl_module, trainer.global_step)  # at the first step, not at the first vote
        self._first_pending = self._first_pending and trainer.global_step == 0
        step = trainer.global_step
        vote = step >= self._first_vote and step % self.settings.every_n_steps == 0 and step != self._last_vote_step
        if vote and self._monitor is not None:  # it waits for the validation of this step or a later one
            self._monitor.pending, vote = True, False
        if vote:
            self._last_vote_step = step
            self.vote_and_merge(trainer, pl_module)
        logs = step % trainer.log_every_n_steps == 0
        # (a vote on `monitor` ran in the last step's validation, where no `log` may run: its mean LR shows now)
        if trainer.is_global_zero and (vote or logs or step - 1 == self._last_vote_step):
            lrs = hdet.table.current_lrs()
            if logs and not vote:  # a vote logged its new learning rates itself
                _log_lrs(trainer, lrs, step, self.report, hdet.explored)
            pl_module.log("hdet/mean_lr", float(lrs[:, 0].mean()), prog_bar=True, logger=False, rank_zero_only=True)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Validate the model a checkpoint holds, unless the vote reads each group's own (``monitor``): then a
        ``sync_dist=True`` metric is reduced inside each group."""
        if self._monitor is None:
            self._parts(trainer).merger.validate_merged(True)
        else:
            self._parts(trainer).sync_metrics_in_groups(True)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        hdet = self._parts(trainer)
        hdet.merger.validate_merged(False)  # before ModelCheckpoint saves (Lightning orders it last)
        hdet.sync_metrics_in_groups(False)
        if self._monitor is None:
            return
        # FSDP2 keeps parameters gathered after a forward without backward: the next forward (and the vote's merge,
        # which writes the shards) must read the shards (as the merged validation's swap-out does).
        hdet.merger.site.reshard()
        if trainer.sanity_checking:
            return
        due = self._monitor.read(trainer.callback_metrics)
        if self._auto and self._monitor.value is None:  # "auto" found no val_loss: back to the training loss
            due, _ = self._monitor.pending, self._set_monitor(None, auto_monitor.missing(trainer.callback_metrics))
        if self._monitor is not None and self._monitor.pending and self._monitor.value is None:
            raise _missing_metric(trainer, self._monitor.name)  # (a misspelled name: now, not after the whole run)
        if due:  # the vote that waited for this validation
            self._last_vote_step = trainer.global_step
            # Lightning runs the validation hooks under inference mode; a vote's merge and restore point must stay
            # normal tensors, updated in place by later votes in training.
            with torch.inference_mode(False), torch.enable_grad():
                self.vote_and_merge(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Leave every rank holding the merged model."""
        finish(self._parts(trainer), self.controller, trainer.global_step == self._last_vote_step,
               lambda: self.vote_and_merge(trainer, pl_module, final=True))

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Every rank keeps :attr:`result`; rank 0 logs the vote history table, the run's figures (W&B gets them as
        images) and the result's summary."""
        self.result = _hand_back(trainer, self, self._parts(trainer))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        finish_worker_run(trainer)

    def hand_back(self) -> Optional[HDETResult]:
        """Rank 0 after a fork/spawn fit: the result the launching process's copy of this callback takes back."""
        return self.result

    def take_back(self, value: HDETResult) -> None:
        self.result = value

    # ------------------------------------------------------------------ the vote
    def vote_and_merge(self, trainer: Trainer, pl_module: LightningModule, final: bool = False) -> None:
        """One vote: losses -> decision (weights, winner, multipliers, rescues) -> merged or rolled-back model."""
        hdet = self._parts(trainer)
        reading = _signal(trainer, hdet, self._meter, self._monitor)
        decision = decide_and_execute(hdet, self.controller, trainer.global_step, reading, final)
        _log_vote(trainer, decision, self.controller.rescues, self.report, final)
        self._meter.reset(trainer.global_step)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        monitored = {} if self._monitor is None else self._monitor.state_dict()
        return {**self.controller.state_dict(), "last_vote_step": self._last_vote_step, **monitored}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict)
        self._last_vote_step = state_dict["last_vote_step"]
        self._loaded = state_dict
        if self._monitor is not None:
            self._monitor.load_state_dict(state_dict)

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add the full ensemble: each group's parameters and optimizer state, multipliers and interval losses."""
        hdet = self._parts(trainer)
        checkpoint["hdet"] = hdet.save_ensemble(self._meter.row(hdet.guard.interval_skipped(reset=False)))
        if getattr(trainer.strategy, "saves_plain_lrs", False):  # (FSDP: the optimizer states are the groups')
            save_plain_lrs(checkpoint, hdet.table.multipliers, self.controller.last_winner)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        restore_schedule_lrs(checkpoint)  # HDET applies its multipliers itself
        self._resumed_interval = self._parts(trainer).load_ensemble(checkpoint.get("hdet"))


def _signal(trainer: Trainer, hdet: HDETParts, meter: IntervalMeter,
            monitor: Optional[MonitoredMetric]) -> Reading:
    """Every group's loss curve for this interval and whether it stayed finite (no skipped step): one small
    all-reduce for all of it."""
    if monitor is not None and monitor.value is None:
        raise _missing_metric(trainer, monitor.name)
    row = meter.row(hdet.guard.interval_skipped(reset=True), None if monitor is None else monitor.value)
    if monitor is not None:
        row = torch.cat([row, monitor.fingerprint(_model_tensors(hdet), hdet.groups.root_device)])
    table = hdet.groups.gather_group_values(row)
    width = meter.width
    reading = meter.read(table[:, :width], monitor is not None)
    tie = None if monitor is None else monitor.check(trainer.global_step, reading.losses,
                                                     table[:, width : width + FINGERPRINT_WIDTH])
    if tie is not None:
        rank_zero_warn(tie)
    if not reading.counted:
        raise _no_training_loss(trainer.global_step)
    return reading


def _no_training_loss(step: int) -> MisconfigurationException:
    return MisconfigurationException(
        f"HDETCallback(monitor=None) votes on the training loss, but no training_step up to step {step} returned"
        " one. Return the loss tensor (or a dict with 'loss') from `training_step` -- also under manual"
        " optimization -- or vote on a logged metric with `monitor=...`.")


def sized_interval(requested: Optional[int], run_steps: Optional[int], warn: bool,
                   announce: bool = False) -> Optional[int]:
    """The vote interval of a run of ``run_steps`` optimizer steps (``None``: not known yet, or unknown):
    :func:`vote_plan`, its warning said where ``warn``; ``None`` where a sized one waits for train start (``announce``:
    it is train start, and a sized interval is said)."""
    every, warning = vote_plan(requested, run_steps)
    if requested is None and run_steps is None and not announce:
        return None  # sized at train start
    length = f"a run of {run_steps} steps" if run_steps is not None else "a run of unknown length"
    _say(f"HDET: a vote every {every} steps ({length})" if announce and requested is None else "",
         warning if warn else None)
    return every


def on_validation_grid(requested: Optional[int], every: int, monitor: str, period: Optional[float]) -> int:
    """The interval of votes on ``monitor``, logged by a validation every ``period`` optimizer steps:
    :func:`~lightning_hdet.hdet.lightning.monitor.validation_plan`, its line and warning said."""
    every, line, warning = validation_plan(requested, every, period, monitor)
    _say(line, warning)
    return every


def _say(line: str, warning: Optional[str]) -> None:
    """On rank 0: ``warning`` as a warning and ``line`` as information, each where there is one."""
    if warning:
        rank_zero_warn(warning)
    if line:
        rank_zero_info(line)


def run_length(trainer: Trainer) -> Optional[int]:
    """The run's optimizer steps: ``max_steps``, or what Lightning estimates for a run bounded by epochs; ``None``
    when unbounded."""
    total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
    return int(total) if math.isfinite(total) and total >= 2 else None


def vote_plan(requested: Optional[int], run_steps: Optional[int]) -> tuple[int, Optional[str]]:
    """The vote interval of a run of ``run_steps`` optimizer steps (``None``: unknown): ``requested``, else
    :func:`~lightning_hdet.hdet.rules.defaults.vote_interval`; and, when fewer than two votes fit, the warning that says
    so with the numbers."""
    every = requested if requested is not None else vote_interval(run_steps)
    if run_steps is None or run_steps >= 2 * every:
        return every, None
    given = f"every_n_steps={every}" if requested is not None else f"the shortest default interval ({every} steps)"
    fix = ("Give a smaller `every_n_steps`" if requested is not None and every > MIN_INTERVAL
           else "Train for more steps")
    return every, (f"HDET: a run of {run_steps} optimizer steps holds {run_steps // every} vote(s) before the final "
                   f"merge at {given}: fewer than two, so the votes barely move the groups' learning rates. "
                   f"{fix} for at least two votes (2 x {every} = {2 * every} steps), or train one group (plain DDP).")


def search_steps(search: Optional[Search], trainer: Trainer) -> Optional[int]:
    """The step at which ``search`` may end (:func:`~lightning_hdet.hdet.lightning.voting.search_end`) in this run
    (:func:`run_length`)."""
    return search_end(search, run_length(trainer), "HDET: the run's length is unknown (no max_steps or max_epochs): "
                      "the search runs the whole run; give HDETCallback(search=Search(steps=...)) to end it.")


def _search_plan(search: Optional[Search], trainer: Trainer) -> str:
    """Where the search ends, as known at set-up (an epoch-bounded run's length is resolved at train start)."""
    if search is None:
        return "no search (the vote runs the whole run)"
    if search.steps is None and trainer.max_steps <= 0:
        return f"the search ends {SEARCH_FRACTION:.0%} into the run's estimated steps"
    steps = search.steps if search.steps is not None else default_search_step(trainer.max_steps)
    return f"the search ends at a vote from step {steps} on"


def _announce(trainer: Trainer, hdet: HDETParts, settings: HDETConfig, plan: str) -> None:
    """The settings line (rank 0), and a warning for callbacks that keep or stop on a metric the vote reads from each
    group's own validation."""
    vote = settings.vote
    blend = "" if vote.copies else f", blend={vote.blend!r}"  # PBT copies, never blends
    every = (f"every {settings.every_n_steps} steps" if settings.every_n_steps is not None
             else "at an interval sized to the run's estimated steps")
    rank_zero_info(f"HDET: {counted(hdet.num_groups, 'group')} of {counted(hdet.groups.layout.group_size, 'rank')}, "
                   f"gradient_sync={hdet.gradient_sync!r}, vote={vote.name!r} {every}{blend}, {plan}")
    if settings.monitor is not None:
        auto_monitor.warn_readers(trainer, hdet.num_groups, settings.monitor)


def _hand_back(trainer: Trainer, callback: HDETCallback, hdet: HDETParts) -> HDETResult:
    """The run's result (every rank); rank 0 also logs the vote history, the figures and the summary."""
    history = callback.history
    result = make_result(history, hdet.table.current_lrs().tolist(), callback.initial_lrs,
                         callback.num_votes, callback.rescues, callback.controller.searched_at,
                         vote_history_locations(trainer) if history else [], table=vote_rows(history),
                         steps=trainer.global_step,
                         every_n_steps=callback.every_n_steps, gradient_sync=hdet.gradient_sync, ties=callback.ties,
                         restarted_at=callback.controller.restarted_at, monitor=callback.settings.monitor)
    if trainer.is_global_zero and hdet.num_groups > 1:
        if history:
            log_vote_history(trainer, history, step=trainer.global_step)
            log_report_figures(trainer, callback.report)
        rank_zero_info(result.summary())
    return result


def _model_tensors(hdet: HDETParts) -> list[Tensor]:
    """What a merge carries of this rank's model (parameters or their local shards, float buffers)."""
    return [t for part in hdet.merger.site.merge_parts() for t in part.tensors]


def _missing_metric(trainer: Trainer, monitor: str) -> MisconfigurationException:
    names = sorted(k for k in trainer.callback_metrics if not k.startswith("hdet/"))
    close = did_you_mean(monitor, names, repr)
    return MisconfigurationException(
        f"HDETCallback(monitor={monitor!r}) found no such metric at the vote at step {trainer.global_step}. Logged "
        f"metrics: {names}.{' ' + close if close else ''} Log it in `validation_step` and validate at least once "
        "before the run ends (a vote waits for the next validation), or use `monitor=None`."
    )


def _log_vote(
    trainer: Trainer, decision: Decision, rescues: int, report: History, final: bool
) -> None:
    """Metrics at the vote's own step (rank 0, every logger) and one console line; the controller already kept the
    history row."""
    metrics = vote_metrics(decision, rescues)
    if trainer.is_global_zero:
        report.add(decision.step, metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=decision.step)
    announce(decision, rescues, final)


def _log_lrs(trainer: Trainer, lrs: Tensor, step: int, report: History, explored: Explored) -> None:
    """Every group's real learning rate (schedule x multiplier), by rank 0 straight to the loggers at Lightning's
    ``log_every_n_steps`` (as ``LearningRateMonitor`` does): multipliers change only at votes, which log them too.
    Going through ``LightningModule.log`` every step cost about 10 % of a small model's step time."""
    num_groups = lrs.shape[0]
    metrics = {f"hdet/group{g}/lr": float(lrs[g, 0]) for g in range(num_groups)}
    for p in range(1, lrs.shape[1]):
        metrics.update({f"hdet/group{g}/lr-pg{p}": float(lrs[g, p]) for g in range(num_groups)})
    metrics["hdet/mean_lr"] = float(lrs[:, 0].mean())
    metrics.update(explored_metrics(values(explored.tables, explored)))
    report.add(step, metrics)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
