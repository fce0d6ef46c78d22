"""HDETCallback: every T steps the groups vote on their losses, learning rates move, parameters are blended.

The rules themselves live in :mod:`lightning_hdet.hdet.votes` (how LRs move) and :mod:`lightning_hdet.hdet.blends` (what the
groups merge toward); the collectives in :class:`~lightning_hdet.hdet.strategy.HDETStrategy`. This callback decides
*when*, keeps the controller's state, runs the safety net, logs, and makes checkpoints resumable.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_hdet._checks import is_finite_number
from lightning_hdet._tensors import host_copy
from lightning_hdet.hdet.blends import BLENDS, blend_coefficients, blend_strengths
from lightning_hdet.records import History, log_report_figures
from lightning_hdet.hdet.strategy import HDETStrategy
from lightning_hdet.hdet.votes import Ballot, divergent, make_rule, winner_of
from lightning_hdet.records.wandb import finish_worker_run, log_vote_history, record_config


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")


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
        _check("every_n_steps", every_n_steps, isinstance(every_n_steps, int) and not isinstance(every_n_steps, bool)
               and every_n_steps >= 1, "a positive integer")
        _check("vote", vote, vote in ("softmax", "best"), "one of ('softmax', 'best')")
        _check("temperature", temperature, is_finite_number(temperature) and temperature > 0, "a positive finite number")
        _check("momentum", momentum, is_finite_number(momentum) and 0 <= momentum < 1, "a number in [0, 1)")
        _check("meta_lr", meta_lr, is_finite_number(meta_lr) and meta_lr >= 0, "a finite number >= 0")
        _check("warmup_steps", warmup_steps, isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool)
               and warmup_steps >= 0, "an integer >= 0")
        _check("permute", permute, isinstance(permute, bool), "True or False")
        _check("shrink", shrink, is_finite_number(shrink) and 0 < shrink <= 1, "a number in (0, 1]")
        _check("min_spread", min_spread, is_finite_number(min_spread) and min_spread > 0, "a positive finite number")
        _check("blend", blend, blend in BLENDS, f"one of {BLENDS}")
        _check("blend_strength", blend_strength, is_finite_number(blend_strength) and 0 < blend_strength <= 1,
               "a number in (0, 1]")
        _check("monitor", monitor, monitor is None or (isinstance(monitor, str) and monitor != ""),
               "None or a logged metric name")
        _check("init_noise", init_noise, is_finite_number(init_noise) and init_noise >= 0, "a finite number >= 0")
        _check("safety_net", safety_net, isinstance(safety_net, bool), "True or False")
        _check("divergence_factor", divergence_factor,
               divergence_factor is None or (is_finite_number(divergence_factor) and divergence_factor > 1),
               "None or a finite number > 1")
        _check("rescue_lr_factor", rescue_lr_factor, is_finite_number(rescue_lr_factor) and 0 < rescue_lr_factor < 1,
               "a number in (0, 1)")
        _check("seed", seed, isinstance(seed, int) and not isinstance(seed, bool), "an integer")
        self.every_n_steps = every_n_steps
        self.vote = vote
        self.warmup_steps = warmup_steps
        self.blend = blend
        self.blend_strength = blend_strength
        self.monitor = monitor
        self.init_noise = init_noise
        self.safety_net = safety_net
        self.divergence_factor = divergence_factor
        self.rescue_lr_factor = rescue_lr_factor
        self.seed = seed
        self.rule = make_rule(vote, temperature, momentum, meta_lr, permute, shrink, min_spread)
        self.config = {
            "every_n_steps": every_n_steps, "vote": vote, "temperature": temperature, "momentum": momentum,
            "meta_lr": meta_lr, "warmup_steps": warmup_steps, "permute": permute, "shrink": shrink,
            "min_spread": min_spread, "blend": blend, "blend_strength": blend_strength, "monitor": monitor,
            "init_noise": init_noise, "safety_net": safety_net, "divergence_factor": divergence_factor,
            "rescue_lr_factor": rescue_lr_factor, "seed": seed,
        }
        self.report = History()  # what this run logged, for the figures at the end of fit (rank 0)
        self.generator = torch.Generator().manual_seed(seed)
        self.history: list[dict[str, Any]] = []
        self.initial_lrs: list[float] = []  # every group's real learning rate when training started
        self.rescues = 0
        self.num_votes = 0
        self.last_winner = -1
        self._last_vote_step = -1
        self._loss_sum: Optional[Tensor] = None
        self._loss_count: Optional[Tensor] = None
        self._skipped_at_vote = 0
        self._monitored: Optional[float] = None
        self._last_good: Optional[Tensor] = None
        self._resumed_interval: Optional[Tensor] = None
        self._last_coefficients: list[float] = []

    # ------------------------------------------------------------------ set-up
    @staticmethod
    def _strategy(trainer: Trainer) -> HDETStrategy:
        strategy = trainer.strategy
        if not isinstance(strategy, HDETStrategy):
            raise MisconfigurationException(
                f"HDETCallback needs `Trainer(strategy='hdet')` (or an HDETStrategy), got {type(strategy).__name__}."
            )
        return strategy

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = self._strategy(trainer)
        if stage == "fit":
            # Runs before the strategy wraps the model, so the guard's DDP hook can be registered.
            strategy.guard_nonfinite = self.safety_net
            record_config(trainer, "hdet", {**strategy.config, "callback": self.config})

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = self._strategy(trainer)
        device = strategy.root_device
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            self._loss_count = torch.zeros((), dtype=torch.float64, device=device)
        if self._resumed_interval is not None:
            row = self._resumed_interval[strategy.group_index] / strategy.layout.group_size
            self._loss_sum.fill_(float(row[0]))
            self._loss_count.fill_(float(row[1]))
            self._resumed_interval = None
        self._skipped_at_vote = strategy.skipped_steps
        self.initial_lrs = strategy.current_lrs()[:, 0].tolist()
        if self._last_good is None:
            self._last_good = host_copy(strategy.flat_state())
        if trainer.ckpt_path is None and self.init_noise > 0:
            self._add_init_noise(strategy, pl_module)
        rank_zero_info(
            f"HDET: {strategy.num_groups} groups of {strategy.layout.group_size} ranks, gradient_sync="
            f"{strategy.gradient_sync!r}, vote={self.vote!r} every {self.every_n_steps} steps, blend={self.blend!r}"
        )

    def _add_init_noise(self, strategy: HDETStrategy, pl_module: LightningModule) -> None:
        """Published warm start: theta_g = theta_0 + eps_g, identical on the ranks of a group."""
        params = [p for p in pl_module.parameters()]
        flat = torch.cat([p.detach().reshape(-1).double() for p in params])
        std = self.init_noise * float(flat.norm()) / math.sqrt(flat.numel())
        gen = torch.Generator().manual_seed(self.seed * 100_003 + strategy.group_index + 1)
        with torch.no_grad():
            for p in params:
                p.add_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * std).to(p.device, p.dtype))

    # ------------------------------------------------------------------ per step
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        strategy = self._strategy(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self._loss_sum += loss.detach().to(self._loss_sum.device, torch.float64).sum()
            self._loss_count += 1
        lrs = strategy.current_lrs()
        metrics = {f"hdet/group{g}/lr": float(lrs[g, 0]) for g in range(strategy.num_groups)}
        for p in range(1, lrs.shape[1]):
            metrics.update({f"hdet/group{g}/lr-pg{p}": float(lrs[g, p]) for g in range(strategy.num_groups)})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)
        if trainer.is_global_zero:
            self.report.add(trainer.global_step, {**metrics, "hdet/base_lr": float(lrs[:, 0].mean())})
        pl_module.log("hdet/base_lr", float(lrs[:, 0].mean()), on_step=True, on_epoch=False, prog_bar=True)
        if self.last_winner >= 0:
            pl_module.log("hdet/leader", float(self.last_winner), on_step=True, on_epoch=False, prog_bar=True)
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0 and step != self._last_vote_step:
            self._last_vote_step = step
            self.vote_and_merge(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self._monitored = float(value)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Leave every rank holding the merged model."""
        strategy = self._strategy(trainer)
        if strategy.num_groups == 1:
            return
        if trainer.global_step == self._last_vote_step:
            # Nothing trained since the last vote: finish that vote's merge at full strength.
            rescued = [c == 0.0 for c in self._last_coefficients]
            strategy.merge(self._last_coefficients, blend_strengths(1.0, rescued))
        else:
            self.vote_and_merge(trainer, pl_module, final=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Rank 0 logs the vote history table and the run's figures (W&B gets them as images)."""
        if not trainer.is_global_zero or not self.history:
            return
        log_vote_history(trainer, self.history, step=trainer.global_step)
        log_report_figures(trainer, self.report)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        finish_worker_run(trainer)

    # ------------------------------------------------------------------ the vote
    def _signal(self, trainer: Trainer, strategy: HDETStrategy) -> tuple[list[float], list[bool]]:
        """Every group's loss signal for this interval, and whether it stayed finite (no skipped step)."""
        skipped = strategy.skipped_steps - self._skipped_at_vote
        if self.monitor is None:
            row = torch.stack([self._loss_sum.cpu(), self._loss_count.cpu(), torch.tensor(float(skipped))])
        else:
            if self._monitored is None:
                names = sorted(k for k in trainer.callback_metrics if not k.startswith("hdet/"))
                raise MisconfigurationException(
                    f"HDETCallback(monitor={self.monitor!r}) found no such metric at the vote at step "
                    f"{trainer.global_step}. Logged metrics: {names}. Log it in `validation_step` (without "
                    "`sync_dist`) and validate at least once per vote interval, or use `monitor=None`."
                )
            row = torch.tensor([self._monitored, 1.0, float(skipped)], dtype=torch.float64)
        table = strategy.gather_group_values(row)
        if self.monitor is None and not bool((table[:, 1] > 0).any()):
            raise MisconfigurationException(
                f"HDETCallback(monitor=None) votes on the training loss, but no training_step up to step "
                f"{trainer.global_step} returned one. Return the loss tensor (or a dict with 'loss') from "
                "`training_step` -- also under manual optimization -- or vote on a logged metric with `monitor=...`."
            )
        losses = [s / c if c > 0 else float("nan") for s, c in zip(table[:, 0].tolist(), table[:, 1].tolist())]
        finite = [(c > 0 and s == 0) for c, s in zip(table[:, 1].tolist(), table[:, 2].tolist())]
        return losses, finite

    def vote_and_merge(self, trainer: Trainer, pl_module: LightningModule, final: bool = False) -> None:
        """One vote: losses -> weights and winner -> new learning rates -> merged parameters."""
        strategy = self._strategy(trainer)
        num_groups = strategy.num_groups
        losses, finite = self._signal(trainer, strategy)
        rescued = divergent(losses, finite, self.divergence_factor) if self.safety_net else [False] * num_groups
        healthy = [not r for r in rescued]
        table = strategy.lr_multipliers
        # With a shared gradient ("global") a group whose *loss* blew up sent huge, still finite gradients into
        # every group before it was caught: nothing from this interval is kept. (Non-finite gradients alone were
        # kept out of the average by the strategy's guard, so those rescues leave the healthy groups alone.)
        blew_up = divergent(losses, [True] * num_groups, self.divergence_factor)
        contaminated = strategy.gradient_sync == "global" and any(r and b for r, b in zip(rescued, blew_up))
        if num_groups > 1 and (not any(healthy) or contaminated):
            self._roll_back(trainer, strategy, losses, rescued)
            return
        move = not final and trainer.global_step >= self.warmup_steps and num_groups > 1
        schedule = strategy.schedule_lrs().tolist()
        weights, winner = [1.0 / num_groups] * num_groups, 0
        for p, schedule_lr in enumerate(schedule):
            ballot = Ballot(p, losses, table[:, p].tolist(), healthy, schedule_lr, move)
            result = self.rule.explore(ballot, self.generator)
            table[:, p] = torch.tensor(result.multipliers, dtype=torch.float64)
            if p == 0:
                weights, winner = result.weights, result.winner
        self._cut_rescued(table, rescued)
        if num_groups > 1:
            coefficients = blend_coefficients(self.blend, weights, winner, healthy)
            self._last_coefficients = coefficients
            strength = 1.0 if final else self.blend_strength
            target = strategy.merge(coefficients, blend_strengths(strength, rescued))
            if bool(torch.isfinite(target).all()):
                self._last_good = host_copy(target, self._last_good)
            if rescued[strategy.group_index]:
                _reset_optimizer_state(strategy)
        strategy.set_lr_multipliers(table)
        self._record(trainer, strategy, losses, weights, winner, rescued, final)

    def _cut_rescued(self, table: Tensor, rescued: list[bool]) -> None:
        """Multiply the rescued groups' rows of the multiplier table by ``rescue_lr_factor`` (in place)."""
        for g, bad in enumerate(rescued):
            if bad:
                table[g] *= self.rescue_lr_factor

    def _roll_back(self, trainer: Trainer, strategy: HDETStrategy, losses: list[float], rescued: list[bool]) -> None:
        """Restore every group to the last good merged model; cut the rescued groups' LRs (all of them if all)."""
        assert self._last_good is not None
        strategy.load_flat(self._last_good)
        _reset_optimizer_state(strategy)
        table = strategy.lr_multipliers
        self._cut_rescued(table, rescued)
        strategy.set_lr_multipliers(table)
        n = strategy.num_groups
        self._last_coefficients = [1.0 / n] * n
        healthy = [not r for r in rescued]
        winner = winner_of(losses, healthy)
        rank_zero_info(
            f"HDET: step {trainer.global_step}: group(s) {[g for g, r in enumerate(rescued) if r]} diverged; every "
            "group rolled back to the last good merged model."
        )
        self._record(trainer, strategy, losses, [1.0 if g == winner else 0.0 for g in range(n)], winner, rescued,
                     final=False)

    def _record(
        self,
        trainer: Trainer,
        strategy: HDETStrategy,
        losses: list[float],
        weights: list[float],
        winner: int,
        rescued: list[bool],
        final: bool,
    ) -> None:
        step = trainer.global_step
        self.rescues += sum(rescued)
        self.num_votes += 0 if final else 1
        self.last_winner = winner
        lrs = strategy.current_lrs()[:, 0].tolist()
        for g in range(strategy.num_groups):
            self.history.append(
                {"step": step, "group": g, "lr": lrs[g], "loss": losses[g], "weight": weights[g],
                 "winner": winner, "rescued": bool(rescued[g])}
            )
        metrics: dict[str, float] = {"hdet/vote/winner": float(winner), "hdet/rescues": float(self.rescues)}
        for g in range(strategy.num_groups):
            metrics[f"hdet/group{g}/loss"] = losses[g]
            metrics[f"hdet/vote/weight{g}"] = weights[g]
            metrics[f"hdet/group{g}/lr"] = lrs[g]  # the new learning rates, at the vote's own step
        metrics["hdet/base_lr"] = sum(lrs) / len(lrs)
        if trainer.is_global_zero:
            self.report.add(step, metrics)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if any(rescued):
            names = [g for g, r in enumerate(rescued) if r]
            rank_zero_info(f"HDET: step {step}: rescued group(s) {names} (losses {losses}); total rescues {self.rescues}")
        self._loss_sum.zero_()
        self._loss_count.zero_()
        self._skipped_at_vote = strategy.skipped_steps

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.state_dict(),
            "generator": self.generator.get_state(),
            "history": list(self.history),
            "rescues": self.rescues,
            "num_votes": self.num_votes,
            "last_winner": self.last_winner,
            "last_vote_step": self._last_vote_step,
            "last_coefficients": list(self._last_coefficients),
            "monitored": self._monitored,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rule.load_state_dict(state_dict["rule"])
        self.generator.set_state(state_dict["generator"])
        self.history = list(state_dict["history"])
        self.rescues = state_dict["rescues"]
        self.num_votes = state_dict["num_votes"]
        self.last_winner = state_dict["last_winner"]
        self._last_vote_step = state_dict["last_vote_step"]
        self._last_coefficients = list(state_dict["last_coefficients"])
        self._monitored = state_dict["monitored"]

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add the full ensemble: each group's parameters and optimizer state, multipliers and interval losses."""
        strategy = self._strategy(trainer)
        skipped = float(strategy.skipped_steps - self._skipped_at_vote)
        row = torch.stack([self._loss_sum.cpu(), self._loss_count.cpu(), torch.tensor(skipped, dtype=torch.float64)])
        checkpoint["hdet"] = {
            "num_groups": strategy.num_groups,
            "lr_multipliers": strategy.lr_multipliers,
            "interval": strategy.gather_group_values(row),
            "groups": strategy.ensemble_state() if strategy.num_groups > 1 else None,
            "last_good": self._last_good.cpu() if self._last_good is not None else None,
        }

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        hdet = checkpoint.get("hdet")
        strategy = self._strategy(trainer)
        if not hdet or hdet.get("num_groups") != strategy.num_groups:
            return
        strategy.set_lr_multipliers(hdet["lr_multipliers"])
        self._resumed_interval = hdet["interval"]
        if hdet.get("last_good") is not None:
            self._last_good = host_copy(hdet["last_good"])


def _reset_optimizer_state(strategy: HDETStrategy) -> None:
    """A rescued group restarts its optimizer state (moments from the diverged region would mislead it)."""
    for optimizer in strategy.optimizers:
        optimizer.state.clear()

