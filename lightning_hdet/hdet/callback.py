"""HDETCallback: every T steps the groups vote on their losses, learning rates move, parameters are blended.

The callback decides and the strategy executes. One vote, top to bottom (:meth:`HDETCallback.vote_and_merge`):

1. ``_signal``: every group's loss over the interval and whether it stayed finite (one small all-reduce through the
   strategy's ``gather_group_values``; the skipped-step count comes from the strategy's reset-on-read counter);
2. ``controller.decide``: the pure :class:`~lightning_hdet.hdet.controller.HDETController` turns those numbers into
   a :class:`~lightning_hdet.hdet.controller.Decision` (rules in :mod:`~lightning_hdet.hdet.votes` and
   :mod:`~lightning_hdet.hdet.blends`);
3. the strategy executes it: ``restore()`` (roll-back) or ``merge(...)``, then ``set_lr_multipliers(...)``;
4. ``_log``: metrics and the vote history.

The callback talks to the strategy only through :class:`~lightning_hdet.hdet.executor.HDETExecutor`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_hdet.hdet.config import HDETConfig
from lightning_hdet.hdet.controller import Decision, HDETController, Interval
from lightning_hdet.hdet.executor import HDETExecutor, is_executor
from lightning_hdet.records import History, log_report_figures
from lightning_hdet.records.wandb import finish_worker_run, log_vote_history, record_config

log = logging.getLogger(__name__)


class HDETCallback(Callback):
    """Loss-based voting, learning-rate exploration, parameter blending and the safety net for HDET.

    Args:
        every_n_steps: the interval T between votes/merges, in optimizer steps.
        vote: ``"softmax"`` (the published auto-LR controller) or ``"best"`` (the lowest loss wins and the other
            groups are re-centred on the winner's multiplier with a shrinking spread).
        temperature: softmax temperature, in the loss's own units (published 0.1; pick about the spread of the
            groups' losses you consider meaningful).
        momentum: momentum of the controller's velocity (published 0.9).
        meta_lr: how far the base LR moves per unit of velocity (published 0.5).
        warmup_steps: votes before this step only merge; learning rates start moving after it.
        permute: give the groups a fresh random permutation of the multipliers after each softmax vote.
        shrink: ``best`` vote: factor by which the log-spread of multipliers narrows each vote, in (0, 1].
        min_spread: ``best`` vote: floor of that log-spread (> 0, variation is never lost).
        blend: merge target: ``"mean"`` (published), ``"weighted"`` (vote weights) or ``"best"`` (the winner).
        blend_strength: s in (0, 1]: ``theta_g <- (1 - s) * theta_g + s * target``.
        monitor: ``None`` votes on each group's mean training loss over the interval; a metric name (e.g.
            ``"val_loss"``) votes on each group's own latest value of that logged metric (log it without
            ``sync_dist`` so each rank keeps its own value).
        init_noise: published warm start: each group starts at ``theta_0 + eps``, ``eps ~ N(0, nu^2 |theta_0|^2 / d)``.
        safety_net: skip the optimizer steps of a group whose loss or gradients are non-finite and restore it.
        divergence_factor: a group whose interval loss exceeds this multiple of the best group's is treated as
            diverged (positive losses only); ``None`` disables the rule.
        rescue_lr_factor: multiplier applied to a rescued group's learning rate (and to every group's when all
            diverged), in (0, 1).
        seed: seed of the callback's own generator for permutations and init noise (never the global RNG).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        vote: str = "softmax",
        temperature: float = 0.1,
        momentum: float = 0.9,
        meta_lr: float = 0.5,
        warmup_steps: int = 0,
        permute: bool = True,
        shrink: float = 0.5,
        min_spread: float = 0.05,
        blend: str = "mean",
        blend_strength: float = 1.0,
        monitor: Optional[str] = None,
        init_noise: float = 0.0,
        safety_net: bool = True,
        divergence_factor: Optional[float] = 10.0,
        rescue_lr_factor: float = 0.5,
        seed: int = 0,
    ) -> None:
        self.settings = HDETConfig(
            every_n_steps, vote, temperature, momentum, meta_lr, warmup_steps, permute, shrink, min_spread, blend,
            blend_strength, monitor, init_noise, safety_net, divergence_factor, rescue_lr_factor, seed,
        )
        self.config = self.settings.as_dict()  # recorded in the run config under ``hdet/callback/...``
        self.controller = HDETController(self.settings)
        self.report = History()  # what this run logged, for the figures at the end of fit (rank 0)
        self.initial_lrs: list[float] = []  # every group's real learning rate when training started
        self._last_vote_step = -1
        self._loss_sum: Optional[Tensor] = None  # this rank's loss over the interval, on the device (no host sync)
        self._loss_count = 0.0  # steps in the interval: a host number, the step count needs no device
        self._monitored: Optional[float] = None
        self._resumed_interval: Optional[Tensor] = None

    # Read-outs (the settings live in `settings`, the vote's state in `controller`).
    @property
    def every_n_steps(self) -> int:
        return self.settings.every_n_steps

    @property
    def vote(self) -> str:
        return self.settings.vote

    @property
    def history(self) -> list[dict[str, Any]]:
        """One row per vote and group: step, group, new LR, loss, weight, winner, rescued."""
        return self.controller.history

    @property
    def rescues(self) -> int:
        return self.controller.rescues

    @property
    def num_votes(self) -> int:
        return self.controller.num_votes

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _executor(trainer: Trainer) -> HDETExecutor:
        strategy = trainer.strategy
        if not is_executor(strategy):
            raise MisconfigurationException(
                f"HDETCallback needs `Trainer(strategy='hdet')` (or an HDETStrategy), got {type(strategy).__name__}."
            )
        return strategy  # type: ignore[return-value]

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        executor = self._executor(trainer)
        if stage == "fit":
            if self.settings.safety_net:
                executor.enable_guard()  # here: before the strategy wraps the model (the guard is a DDP hook)
            record_config(trainer, "hdet", {**executor.config, "callback": self.config})

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        executor = self._executor(trainer)
        device = executor.root_device
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        if self._resumed_interval is not None:
            row = self._resumed_interval[executor.group_index] / executor.layout.group_size
            self._loss_sum.fill_(float(row[0]))
            self._loss_count = float(row[1])
            self._resumed_interval = None
        self.initial_lrs = executor.current_lrs()[:, 0].tolist()
        executor.ensure_restore_point()
        if trainer.ckpt_path is None and self.settings.init_noise > 0:
            executor.add_init_noise(self.settings.init_noise, self.controller.noise_seed(executor.group_index))
        rank_zero_info(
            f"HDET: {executor.num_groups} groups of {executor.layout.group_size} ranks, gradient_sync="
            f"{executor.gradient_sync!r}, vote={self.settings.vote!r} every {self.settings.every_n_steps} steps, "
            f"blend={self.settings.blend!r}"
        )

    # ------------------------------------------------------------------ per step
    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        executor = self._executor(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):  # one in-place add on the device: no host sync, no new tensor to keep
            self._loss_sum.add_(loss.detach() if loss.dim() == 0 else loss.detach().sum())
            self._loss_count += 1
        step = trainer.global_step
        vote = step > 0 and step % self.settings.every_n_steps == 0 and step != self._last_vote_step
        if vote:
            self._last_vote_step = step
            self.vote_and_merge(trainer, pl_module)
        if trainer.is_global_zero and (vote or step % trainer.log_every_n_steps == 0):
            lrs = executor.current_lrs()
            if not vote:  # a vote logged its new learning rates itself
                self._log_lrs(trainer, lrs, step)
            pl_module.log("hdet/base_lr", float(lrs[:, 0].mean()), prog_bar=True, logger=False, rank_zero_only=True)
            if self.controller.last_winner >= 0:
                pl_module.log("hdet/leader", float(self.controller.last_winner), prog_bar=True, logger=False,
                              rank_zero_only=True)

    def _log_lrs(self, trainer: Trainer, lrs: Tensor, step: int) -> None:
        """Every group's real learning rate (schedule x multiplier), by rank 0 straight to the loggers at Lightning's
        ``log_every_n_steps`` (as ``LearningRateMonitor`` does): multipliers change only at votes, which log them too.
        Going through ``LightningModule.log`` every step cost about 10 % of a small model's step time."""
        num_groups = lrs.shape[0]
        metrics = {f"hdet/group{g}/lr": float(lrs[g, 0]) for g in range(num_groups)}
        for p in range(1, lrs.shape[1]):
            metrics.update({f"hdet/group{g}/lr-pg{p}": float(lrs[g, p]) for g in range(num_groups)})
        metrics["hdet/base_lr"] = float(lrs[:, 0].mean())
        self.report.add(step, metrics)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.settings.monitor is None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.settings.monitor)
        if value is not None:
            self._monitored = float(value)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Leave every rank holding the merged model."""
        executor = self._executor(trainer)
        if executor.num_groups == 1:
            return
        if trainer.global_step == self._last_vote_step:
            # Nothing trained since the last vote: finish that vote's merge at full strength.
            coefficients, strengths = self.controller.finishing_merge()
            executor.merge(coefficients, strengths, restart=[False] * executor.num_groups)
        else:
            self.vote_and_merge(trainer, pl_module, final=True)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Rank 0 logs the vote history table and the run's figures (W&B gets them as images)."""
        if not trainer.is_global_zero or not self.history:
            return
        log_vote_history(trainer, self.history, step=trainer.global_step)
        log_report_figures(trainer, self.report)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        finish_worker_run(trainer)

    # ------------------------------------------------------------------ the vote
    def vote_and_merge(self, trainer: Trainer, pl_module: LightningModule, final: bool = False) -> None:
        """One vote: losses -> decision (weights, winner, multipliers, rescues) -> merged or rolled-back model."""
        executor = self._executor(trainer)
        losses, finite = self._signal(trainer, executor)
        decision = self.controller.decide(Interval(
            step=trainer.global_step, losses=losses, finite=finite, multipliers=executor.lr_multipliers,
            schedule_lrs=executor.schedule_lrs().tolist(), shared_gradients=executor.gradient_sync == "global",
            final=final,
        ))
        if decision.roll_back:
            executor.restore()
            rank_zero_info(
                f"HDET: step {decision.step}: group(s) {_indices(decision.rescued)} diverged; every group rolled "
                "back to the last good merged model."
            )
        elif executor.num_groups > 1:
            executor.merge(decision.coefficients, decision.strengths, restart=decision.rescued)
        executor.set_lr_multipliers(decision.multipliers)
        self._log_vote(trainer, decision)
        self._loss_sum.zero_()
        self._loss_count = 0.0

    def _signal(self, trainer: Trainer, executor: HDETExecutor) -> tuple[list[float], list[bool]]:
        """Every group's loss signal for this interval, and whether it stayed finite (no skipped step)."""
        table = executor.gather_group_values(self._interval_row(trainer, executor, reset=True))
        if self.settings.monitor is None and not bool((table[:, 1] > 0).any()):
            raise MisconfigurationException(
                f"HDETCallback(monitor=None) votes on the training loss, but no training_step up to step "
                f"{trainer.global_step} returned one. Return the loss tensor (or a dict with 'loss') from "
                "`training_step` -- also under manual optimization -- or vote on a logged metric with `monitor=...`."
            )
        losses = [s / c if c > 0 else float("nan") for s, c in zip(table[:, 0].tolist(), table[:, 1].tolist())]
        finite = [(c > 0 and s == 0) for c, s in zip(table[:, 1].tolist(), table[:, 2].tolist())]
        return losses, finite

    def _interval_row(self, trainer: Trainer, executor: HDETExecutor, reset: bool) -> Tensor:
        """This rank's ``[loss sum, loss count, skipped steps]`` of the interval (``reset``: a new interval starts)."""
        skipped = torch.tensor(float(executor.interval_skipped(reset=reset)), dtype=torch.float64)
        if self.settings.monitor is None:
            return torch.stack([self._loss_sum.cpu(), torch.tensor(self._loss_count, dtype=torch.float64), skipped])
        if self._monitored is None:
            names = sorted(k for k in trainer.callback_metrics if not k.startswith("hdet/"))
            raise MisconfigurationException(
                f"HDETCallback(monitor={self.settings.monitor!r}) found no such metric at the vote at step "
                f"{trainer.global_step}. Logged metrics: {names}. Log it in `validation_step` (without "
                "`sync_dist`) and validate at least once per vote interval, or use `monitor=None`."
            )
        return torch.tensor([self._monitored, 1.0, float(skipped)], dtype=torch.float64)

    def _log_vote(self, trainer: Trainer, decision: Decision) -> None:
        """Metrics at the vote's own step (rank 0, every logger); the controller already kept the history row."""
        metrics: dict[str, float] = {"hdet/vote/winner": float(decision.winner),
                                     "hdet/rescues": float(self.controller.rescues)}
        for g, (loss, weight, lr) in enumerate(zip(decision.losses, decision.weights, decision.lrs)):
            metrics[f"hdet/group{g}/loss"] = loss
            metrics[f"hdet/vote/weight{g}"] = weight
            metrics[f"hdet/group{g}/lr"] = lr  # the new learning rates, at the vote's own step
        metrics["hdet/base_lr"] = sum(decision.lrs) / len(decision.lrs)
        if trainer.is_global_zero:
            self.report.add(decision.step, metrics)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=decision.step)
        if any(decision.rescued):
            rank_zero_info(f"HDET: step {decision.step}: rescued group(s) {_indices(decision.rescued)} (losses "
                           f"{decision.losses}); total rescues {self.controller.rescues}")

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self.controller.state_dict(), "last_vote_step": self._last_vote_step, "monitored": self._monitored}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.controller.load_state_dict(state_dict)
        self._last_vote_step = state_dict["last_vote_step"]
        self._monitored = state_dict["monitored"]

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add the full ensemble: each group's parameters and optimizer state, multipliers and interval losses."""
        executor = self._executor(trainer)
        row = torch.stack([self._loss_sum.cpu(), torch.tensor(self._loss_count, dtype=torch.float64),
                           torch.tensor(float(executor.interval_skipped(reset=False)), dtype=torch.float64)])
        checkpoint["hdet"] = {
            "num_groups": executor.num_groups,
            "interval": executor.gather_group_values(row),
            **executor.save_ensemble(),
        }

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        hdet = checkpoint.get("hdet")
        executor = self._executor(trainer)
        if not hdet or hdet.get("num_groups") != executor.num_groups:
            return
        executor.load_ensemble(hdet)
        self._resumed_interval = hdet["interval"]


def _indices(flags: list[bool]) -> list[int]:
    return [g for g, flag in enumerate(flags) if flag]
