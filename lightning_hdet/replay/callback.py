"""HDETReplay: train a plain DDP or FSDP run (or one GPU) on the learning-rate trajectory an HDET run found (and
that of every other hyperparameter it explored).

The Lightning glue of :mod:`~lightning_hdet.replay.trajectory`: at the start of ``fit`` it attaches
:class:`~lightning_hdet.replay.trajectory.ReplayHooks` to every optimizer (from the run's ``global_step``, so a
resumed run continues where it was), removes them at the end, and checkpoints the multipliers it computed.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_hdet._checks import KnownArguments
from lightning_hdet.hdet.execution.executor import is_executor
from lightning_hdet.replay.sources import Initial, Source
from lightning_hdet.replay.trajectory import LRTrajectory, ReplayHooks


class HDETReplay(KnownArguments, Callback):
    """Replay the winning LR trajectory of a finished HDET run, step by step (Ray Tune's
    ``PopulationBasedTrainingReplay`` for HDET): "search small, replay big".

    Args:
        source: the HDET run: its log dir (holding ``vote_history.csv`` and ``hparams.yaml``), the
            ``vote_history.csv``, a checkpoint (Trainer or Fabric), or the vote-history rows themselves.
        initial_multipliers: every group's LR multiplier when the HDET run started; ``None`` reads them from the
            run config (``hdet/lr_multipliers`` in ``hparams.yaml``), which a checkpoint or rows do not hold. A run
            that explored other hyperparameters (``HDETStrategy(explore=...)``) also needs theirs:
            ``{"lr": [...], "weight_decay": [...]}`` (the run config's ``hdet/explore/<name>``).

    The replaying run needs the HDET run's optimizer and schedule (the multipliers are replayed on top of it) and
    counts the same optimizer steps; its strategy must be a plain one (``"ddp"``, ``"fsdp"``, one device).
    """

    def __init__(self, source: Source, initial_multipliers: Optional[Initial] = None) -> None:
        self.trajectory = LRTrajectory.from_run(source, initial_multipliers)
        self._hooks: list[ReplayHooks] = []
        self._resumed: dict[str, Any] = {}

    @property
    def multipliers(self) -> dict[int, float]:
        """The multiplier of every piece reached so far (the first optimizer's)."""
        return dict(self._hooks[0].multipliers) if self._hooks else dict(self._resumed.get("multipliers", {}))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_executor(trainer.strategy):
            raise ValueError(f"HDETReplay replays an HDET run's LRs in a plain run; got strategy "
                             f"{type(trainer.strategy).__name__}, which runs HDET itself. Use 'ddp', 'fsdp' or one device.")
        step, known = trainer.global_step, self._resumed.get("multipliers")
        explored = self._resumed.get("explored")
        self._hooks = [ReplayHooks(self.trajectory, step, known, explored).attach(opt) for opt in trainer.optimizers]
        pieces = self.trajectory.pieces
        rank_zero_info(f"HDETReplay: {len(pieces)} LR pieces from steps {[p.start for p in pieces]} (groups "
                       f"{[p.group for p in pieces]}), starting at step {step}")

    @property
    def explored_multipliers(self) -> dict[int, dict[str, float]]:
        """The other explored hyperparameters' multipliers of every piece reached so far (the first optimizer's)."""
        return dict(self._hooks[0].explored) if self._hooks else dict(self._resumed.get("explored", {}))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resumed = self.state_dict()
        for hooks in self._hooks:
            hooks.detach()
        self._hooks = []

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"multipliers": self.multipliers, "explored": self.explored_multipliers}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict)
