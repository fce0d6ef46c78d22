"""DiLoCo across Lightning jobs on torchft: the glue between Lightning's hooks and :class:`~.rounds.ReplicaRound`."""

from __future__ import annotations

import logging
from dataclasses import fields
from datetime import timedelta
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hdet._checks import check_names, own_arguments, require
from lightning_hdet.asynchronous.lightning.limits import LoopLimits
from lightning_hdet.asynchronous.outer.base import OuterOptimizer
from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.lookahead import refuse_lookahead
from lightning_hdet.asynchronous.outer.momentum import refuse_moved
from lightning_hdet.asynchronous.outer.settings import OuterSettings
from lightning_hdet.asynchronous.wire.codecs import BF16, Codec, NoCodec, codec_from
from lightning_hdet.torchft.rounds import ReplicaRound, RoundOutcome
from lightning_hdet.torchft.settings import TorchFT

log = logging.getLogger(__name__)
_CHECKPOINT_KEY = "torchft"
_GONE = ("rank %d: this job was left out of the end of round %d, and its next quorum neither healed it nor held the "
         "%d jobs of that round (%d now): the jobs that reduced that round without it have ended, failed or look "
         "dead to the Lighthouse (beats delayed past --heartbeat_timeout_ms). It ends here, holding the global model "
         "of that round's start; the others' final model is the run's (e.g. in their checkpoints). Training on would "
         "make a model apart from theirs under the same round numbers")


class TorchFTStrategy(DDPStrategy):
    """DiLoCo (``mode="sync"``) with torchft as its fault-tolerance engine: each Lightning job is one replica group.

    Inside a job its ranks train as DDP (one node, say); every ``local_steps`` steps the jobs live in the round's
    quorum reduce their pseudo-gradients through torchft and every job runs the same outer step (no rank is a
    server). A job that dies or freezes during its inner steps misses the round's second, shrink-only quorum before
    the allreduce (once its heartbeats are the Lighthouse's heartbeat timeout old) and the others reduce without it;
    one that dies inside the allreduce fails it, and the round is discarded and trained again. A live job later than
    the Lighthouse's join timeout at that quorum is left out of it too: after ``timeout`` it discards its round and
    heals at a later round's start; left out of one of the run's last two rounds, or where its next quorum holds
    none of the jobs that reduced without it (they ended or failed), it ends there, behind the others' final model
    (``ended_behind``, and a warning); ``TorchFT.max_discarded_rounds`` rounds in a row discarded, left out or not
    committed, end it with an error. Where the jobs of a round's quorum hold different global models (jobs
    committed rounds in quorums apart), every one of them ends with ``SplitBrainError``. A new or restarted job
    heals from a live peer at a round's start and joins. The run ends after ``max_steps / local_steps`` committed
    rounds, the same for every job (a job that joined late included).

    Args:
        torchft: the Lighthouse, ``min_replicas`` and timeouts (:class:`~.settings.TorchFT`).
        local_steps: ``H``, inner steps per round.
        mode: ``"sync"`` only: torchft's quorum meets at a round's start, so every job waits for the others
            (asynchronous Local-SGD across jobs: ``OuterService`` with ``ElasticWorkerStrategy``).
        outer: the outer optimizer, as for ``AsyncLocalSGDStrategy(mode="sync")``: ``Nesterov(lr, momentum)``,
            ``DelayedNesterov(...)`` (in DiLoCo Nesterov with its momentum schedule) or a preset's name (``"stable"``
            by default); ``SparseLoCo`` is not supported (torchft's dense allreduce does not carry sparse rounds).
        check_pushes: ``True`` (``PushCheck()``), a ``PushCheck(max_norm_ratio, max_rejections)`` or ``False``: each
            job checks its pseudo-gradient before it is reduced (finite, a norm within ``max_norm_ratio`` times its
            own recent median); a rejected one is left out of the round's mean and its job restarts from the global
            model; a job rejected in ``max_rejections`` rounds in a row ends with an error, the others go on.
        compression: what the round's allreduce carries: ``NoCodec()`` (``"none"``, float32) or ``BF16()``
            (``"bf16"``: half the bytes; the sum is rounded to bfloat16 as it travels). ``Int8`` and ``TopK`` are not
            supported: torchft's allreduce adds the jobs' tensors on the way, which their scales and indices are not.
        **kwargs: passed to Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (inside the job).
    """

    strategy_name = "torchft_diloco"

    def __init__(self, torchft: TorchFT, local_steps: int = 50, mode: str = "sync",
                 outer: OuterOptimizer | str | None = None, check_pushes: PushCheck | bool = True,
                 compression: Codec | str = "none", **kwargs: Any) -> None:
        refuse_moved(type(self).__name__, kwargs)
        check_names(type(self).__name__, kwargs, own_arguments(type(self)),
                    {"Lightning DDPStrategy": own_arguments(DDPStrategy)})
        require("torchft", torchft, isinstance(torchft, TorchFT), "a TorchFT(lighthouse=..., min_replicas=...)")
        require("mode", mode, mode == "sync", "'sync'",
                "torchft's quorum meets at every round's start, so its DiLoCo is synchronous; for asynchronous "
                "Local-SGD across jobs use OuterService with ElasticWorkerStrategy (docs/elastic.md).")
        self.outer_settings = OuterSettings(mode="sync", local_steps=local_steps, outer=outer,
                                            check_pushes=check_pushes)
        refuse_lookahead(self.outer_settings.outer, "TorchFTStrategy", "Its replicas step the outer optimizer"
                         " each on its own, with no validation loop between allreduce and step.")
        if self.outer_settings.outer.forwards_rounds:
            raise ValueError(f"`outer={self.outer_settings.outer!r}` is not supported by TorchFTStrategy: its rounds "
                             "forward the workers' sparse messages, which torchft's dense allreduce does not carry. "
                             "Use Nesterov(...) or DelayedNesterov(...), or AsyncLocalSGDStrategy(mode='sync').")
        self.compression = codec_from(compression)
        require("compression", self.compression, isinstance(self.compression, (NoCodec, BF16)), "NoCodec() or BF16()",
                "torchft's allreduce adds the jobs' tensors on the way, which Int8's scales and TopK's indices are "
                "not; BF16() halves the bytes.")
        super().__init__(**kwargs)
        self.torchft, self.local_steps = torchft, local_steps
        #: the run's round (committed by the live jobs; a healed job's jumps), rounds this job committed,
        #: discarded (a job failed in them), had its pseudo-gradient rejected in, and heals from a live peer
        self.round = self.rounds_committed = self.rounds_discarded = self.rounds_rejected = self.healed = 0
        #: this job was left out of a round and ended there, behind the final model the other jobs hold: one of the
        #: run's last two rounds, or one whose other jobs were gone at the next quorum
        self.ended_behind = False
        #: the jobs of the round this job's last round started with, and of the one it was last left out of
        self._jobs, self._left_out_of = 0, 0
        self._round: Optional[ReplicaRound] = None
        self._manager: Any = None
        self._steps = 0
        self._rounds = 0
        self._limits = LoopLimits()
        self._resume: Optional[dict[str, Any]] = None

    @property
    def config(self) -> dict[str, Any]:
        """The settings in force (the outer numbers as resolved)."""
        torchft = {f"torchft_{f.name}": getattr(self.torchft, f.name) for f in fields(TorchFT)}
        return {**self.outer_settings.numbers(), "compression": type(self.compression).__name__, **torchft}

    @override
    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:  # before any process group
            max_steps = trainer.max_steps
            require("max_steps", max_steps, max_steps > 0 and max_steps % self.local_steps == 0,
                    f"a positive multiple of local_steps={self.local_steps}",
                    "Every job runs max_steps / local_steps rounds of local_steps inner steps.")
        super().setup_environment()

    @override
    def configure_ddp(self) -> None:
        if self.world_size > 1:  # one rank has no gradients to reduce: DDP would only add work to every step
            super().configure_ddp()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"{type(self).__name__} needs exactly one (inner) optimizer, got {len(self.optimizers)}.")
        self._rounds = trainer.max_steps // self.local_steps
        self._limits.lift(trainer)  # failed rounds are trained again: the committed rounds, not the loop, end it
        # the manager (and its heartbeats) now, before the rest of Lightning's start-up: the Lighthouse then waits
        # (its join timeout) for this job at the first quorum rather than forming it without a job still starting
        env = self.cluster_environment
        assert env is not None
        self._manager = self.torchft.connect(self.global_rank, self.world_size, env.main_address, env.main_port)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        checks = self.outer_settings.check_pushes
        check = checks.fresh() if checks is not None else None
        wire = torch.bfloat16 if isinstance(self.compression, BF16) else torch.float32
        self._round = ReplicaRound(self.lightning_module, self.root_device, self._manager, self._outer, check, wire,
                                   round_end_timeout=timedelta(seconds=self.torchft.timeout))
        if self._resume is not None:  # the checkpoint's round; a job still training further on heals this one
            self._round.load_state_dict(self._resume["round"])
            self._manager.load_state_dict(self._resume["manager"])
            self._resume = None
        self._steps, self.ended_behind = 0, False
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.logger is not None:
            trainer.logger.log_hyperparams({f"torchft/{k}": v for k, v in self.config.items()})
        self._start_round()

    def _outer(self, params: Tensor) -> Optimizer:
        """DiLoCo's outer step: the outer optimizer object's, as every replica runs it (DiLoCo's ``N = 1``)."""
        return self.outer_settings.outer.optimizer([params], "sync", 1)

    def _start_round(self) -> None:
        assert self._round is not None
        before = self._manager.current_step()
        self._round.start()
        self.round = self._manager.current_step()
        if self.round != before:  # healed from a live peer (a new or restarted job)
            self.healed += 1
            log.info("rank %d: healed to round %d", self.global_rank, self._manager.current_step())
        left_out_of, self._left_out_of, self._jobs = self._left_out_of, 0, self._manager.num_participants()
        if self.round == before and self._jobs < left_out_of:
            # no job that reduced the round this one missed is here (it would be a round ahead, and heal this one),
            # and fewer jobs: they ended, failed or look dead. Going on (min_replicas allowing) would train apart
            # from their model, which torchft's round numbers cannot tell from the run's
            self.ended_behind = True
            log.warning(_GONE, self.global_rank, self.round, left_out_of, self._jobs)
        log.debug("rank %d: round %d starts with %d jobs", self.global_rank, self._manager.current_step(),
                  self._manager.num_participants())

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._round is None:
            return output
        self._steps += 1
        if self._steps == self.local_steps:
            self._steps = 0
            outcome = self._round.finish()
            self._after_round(outcome, optimizer)
            self.round = self._manager.current_step()
            if self.round < self._rounds and not self.ended_behind:
                self._start_round()  # which may find that the jobs ahead are gone: ended_behind
            if self.round >= self._rounds or self.ended_behind:
                self.lightning_module.trainer.should_stop = True
        return output

    def _after_round(self, outcome: RoundOutcome, optimizer: Optimizer) -> None:
        log.debug("rank %d: round end, step %d: %s", self.global_rank, self._manager.current_step(), outcome)
        if not outcome.committed:
            self._discarded(outcome.left_out)
            return
        self.rounds_committed += 1
        if outcome.rejected is not None:
            self.rounds_rejected += 1
            optimizer.state.clear()  # as a rejected async push does: the inner state led it astray
            log.warning("rank %d: this job's round was rejected (%s)", self.global_rank, outcome.rejected)
            assert self._round is not None
            checks = self.outer_settings.check_pushes
            if checks is not None and self._round.rejected_streak >= checks.max_rejections:
                raise RuntimeError(f"{type(self).__name__}: this job's pseudo-gradient was rejected in "
                                   f"{checks.max_rejections} rounds in a row (last: {outcome.rejected}); it leaves the "
                                   "run, the other jobs go on (`max_rejections`).")
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.logger is not None:
            trainer.logger.log_metrics({"torchft/round": self._manager.current_step(), "torchft/accepted":
                                        outcome.accepted, "torchft/discarded": self.rounds_discarded},
                                       step=trainer.global_step)

    def _discarded(self, left_out: bool) -> None:
        """A round that did not commit, whatever the cause: counted, and ``max_discarded_rounds`` of them in a row
        end the job."""
        assert self._round is not None
        self.rounds_discarded += 1
        limit = self.torchft.max_discarded_rounds
        if self._round.discarded_streak >= limit:
            last = ("this job was left out of its end" if left_out else
                    "torchft did not commit it (a job failed during it, or fewer than min_replicas were left)")
            raise RuntimeError(
                f"{type(self).__name__}: this job discarded {limit} rounds in a row "
                f"(`TorchFT(max_discarded_rounds={limit})`), the last because {last}, so it trained for nothing. A "
                "job is left out of a round's end where it gets there later than the Lighthouse's --join_timeout_ms "
                "after the others: start the Lighthouse with a --join_timeout_ms above this job's lag, or check this "
                "node (slower than the others, overloaded, paused); a round is not committed where a job fails during "
                "it: see the other jobs' logs. The other jobs go on.")
        if left_out:
            self._left_out()
        else:
            log.warning("rank %d: round discarded (a job failed during it); training it again", self.global_rank)

    def _left_out(self) -> None:
        """This job reached the round's end later than the Lighthouse's join timeout after the others, which reduced
        without it: its round is discarded. The others start the next round before it is back (their quorum waits
        the join timeout for it), so it heals at the start of the one after; where no such round is left, it ends."""
        round_ = self._manager.current_step()
        if round_ + 2 >= self._rounds:  # a quorum now would wait out quorum_timeout for jobs that have ended
            self.ended_behind = True
            log.warning("rank %d: this job reached the end of round %d (the run's rounds: 0 to %d) later than the "
                        "Lighthouse's --join_timeout_ms after the others, which reduced it without this job and (at "
                        "most one round later) end the run: this job's round is discarded and it ends now, holding the "
                        "global model of that round's start, %d outer step(s) before the final model, which the other "
                        "jobs hold (e.g. in their checkpoints)", self.global_rank, round_, self._rounds - 1,
                        self._rounds - round_)
            return
        self._left_out_of = self._jobs
        log.warning("rank %d: this job reached the round's end later than the Lighthouse's --join_timeout_ms after "
                    "the others, which reduced without it; its round is discarded and it heals from a live peer at a "
                    "later round's start (a join timeout longer than a job's lag keeps it in)", self.global_rank)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Also the run's round, global model and outer state (exact at a round's end, e.g.
        ``ModelCheckpoint(every_n_train_steps=local_steps)``; mid-round the resumed job restarts that round)."""
        if self._round is not None:
            checkpoint[_CHECKPOINT_KEY] = {"round": self._round.state_dict(), "manager": self._manager.state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, **kwargs)  # weights_only: on newer Lightning only
        self._resume = checkpoint.get(_CHECKPOINT_KEY)
        check_lineage_saved(self._resume, checkpoint_path)
        return checkpoint

    def _close(self) -> None:
        self._round = None
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    @override
    def on_train_end(self) -> None:
        self._close()
        self._limits.restore(self.lightning_module)
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close()
        self._limits.restore(self.lightning_module)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._close()
        super().teardown()


def check_lineage_saved(resume: Optional[dict[str, Any]], checkpoint_path: Any) -> None:
    """Refuse a checkpoint whose round has no lineage (a development build's, from before split-brain detection).
    Starting a lineage afresh is not safe: two jobs resumed from different models would both hold the fresh one, so
    their first quorum would see one lineage and average the two models on silently (the split brain the lineage is
    there to stop); and none can be derived that a live job's chained lineage would match."""
    if resume is None or "lineage" in resume["round"]:
        return
    raise ValueError(
        f"The checkpoint {checkpoint_path} holds no `{_CHECKPOINT_KEY}` -> `round` -> `lineage`: it was written by a "
        "development build from before split-brain detection, and a lineage cannot be made up for it (jobs resumed "
        "from different models would then look alike to each other). Resume from a checkpoint this version wrote, "
        "or start the run afresh from its weights: load its `state_dict` into the module and call `fit` without "
        "`ckpt_path`.")
