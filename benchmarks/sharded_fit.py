"""One fit of benchmark 4's ``sharded`` part, under Lightning's subprocess launcher (``ModelParallelStrategy`` has
no spawn launcher, so every arm of that part runs this way): the launcher re-runs this command once per extra
rank, and every rank writes its :class:`~benchmarks.overhead.Probe` and :class:`~benchmarks.overhead.MemoryProbe`
records to ``OUT``.

Arms (``W`` processes, ``G`` HDET groups, the char LM with one FSDP unit per Transformer block where sharded):

- ``ddp``: Lightning's ``DDPStrategy``;
- ``hdet``: ``HDETStrategy(num_groups=G)``, gradients averaged over all ranks, a vote and merge every ``T`` steps;
- ``fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=W)``, ``fully_shard`` over all ``W`` ranks in
  ``configure_model`` (as its users write it);
- ``hdet_fsdp``: ``HDETFSDPStrategy(num_groups=G)``: each group shards over ``W / G`` ranks, gradients averaged
  over the groups (HSDP-like), a vote and merge every ``T`` steps.

Usage (called by ``overhead.py --parts sharded``): ``python benchmarks/sharded_fit.py ARM OUT SETTINGS_JSON``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything
from torch import nn
from torch.distributed.fsdp import fully_shard

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RunSpec, build_workload  # noqa: E402
from benchmarks.overhead import MemoryProbe, Probe  # noqa: E402
from lightning_hdet.demos import CharLM  # noqa: E402

ARMS = ("ddp", "hdet", "fsdp2", "hdet_fsdp")


class FSDP2CharLM(CharLM):
    """The char LM sharded the way a ``ModelParallelStrategy`` user shards it: each block, then the root."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def strategy_and_callbacks(arm: str, settings: dict) -> tuple[object, list[Callback]]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_hdet import HDETCallback, HDETFSDPStrategy, HDETStrategy

    groups, every = settings["groups"], settings["every"]
    if arm == "ddp":
        return DDPStrategy(process_group_backend="gloo"), []
    if arm == "hdet":
        strategy = HDETStrategy(num_groups=groups, spread=1 / 9, gradient_sync="global", process_group_backend="gloo")
        return strategy, [HDETCallback(every_n_steps=every, search=False)]
    if arm == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=settings["world_size"], tensor_parallel_size=1), []
    if arm == "hdet_fsdp":
        strategy = HDETFSDPStrategy(num_groups=groups, spread=1 / 9, gradient_sync="global",
                                    auto_wrap_policy={nn.TransformerEncoderLayer})
        return strategy, [HDETCallback(every_n_steps=every, search=False)]
    raise ValueError(f"arm={arm!r} is not one of {ARMS}")


def main(arm: str, out: Path, settings: dict) -> None:
    warnings.filterwarnings("ignore")
    strategy, callbacks = strategy_and_callbacks(arm, settings)
    spec = RunSpec(lr=1e-3, steps=settings["steps"], devices=settings["world_size"], batch_size=settings["batch_size"],
                   max_chars=settings["max_chars"], model={"d_model": settings["d_model"], "n_layers": 4})
    seed_everything(0, verbose=False)
    model, data = build_workload(spec)
    if arm == "fsdp2":
        model = FSDP2CharLM(block_size=spec.block_size, lr=spec.lr, **spec.model)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu", devices=spec.devices, strategy=strategy, max_steps=spec.steps, limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
        callbacks=[Probe(out), MemoryProbe(out), *callbacks],
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3]))
