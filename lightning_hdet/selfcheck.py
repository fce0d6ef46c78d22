"""Does lightning-hdet work with the torch and Lightning installed here? ``python -m lightning_hdet.selfcheck``.

The compatibility check for versions the test suite does not run on (older PyTorch builds, GPU machines): a few
tiny fits through the launchers users use, each a pass or a failure with its error, and the versions:

1. ``Trainer(strategy="hdet_spawn")``: groups, votes, a checkpoint and a resume from it;
2. ``Trainer(strategy="diloco_spawn")``: the async exchange;
3. ``Fabric(strategy="hdet_spawn")`` with :class:`~lightning_hdet.fabric.loop.HDETLoop`, and ``fabric.save``.

``--accelerator gpu --devices N`` runs them on N GPUs (NCCL; one process per GPU); the default is 2 CPU processes
(gloo). Exit status 0 when every check passed. Importing :mod:`lightning_hdet` already checks the private Lightning
names it relies on (``lightning_hdet/_compat.py``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import lightning
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_hdet
from lightning_hdet import HDETCallback, HDETLoop


def _trainer(args: argparse.Namespace, strategy: str, steps: int, **kwargs: Any) -> Trainer:
    return Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=steps,
                   logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   **kwargs)


def check_hdet_trainer(args: argparse.Namespace, out: Path) -> str:
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=-1)
    _trainer(args, "hdet_spawn", 8, callbacks=[HDETCallback(every_n_steps=4), ckpt]).fit(BoringModel())
    saved = sorted(p.name for p in out.glob("*.ckpt"))
    if len(saved) != 2:
        raise RuntimeError(f"expected checkpoints at steps 4 and 8, found {saved}")
    _trainer(args, "hdet_spawn", 12, callbacks=[HDETCallback(every_n_steps=4)], enable_checkpointing=False).fit(
        BoringModel(), ckpt_path=out / saved[-1])
    return f"8 steps, votes at 4 and 8, checkpoints {saved}; resumed from {saved[-1]} to step 12"


def check_diloco_trainer(args: argparse.Namespace, out: Path) -> str:
    _trainer(args, "diloco_spawn", 8, enable_checkpointing=False).fit(BoringModel())
    return "8 steps per worker on average, rounds of 50 (the budget ends the first)"


def _fabric_loop(fabric: Fabric, path: Path) -> int:
    model = torch.nn.Linear(32, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    hdet = HDETLoop(fabric, every_n_steps=4)
    for _ in range(8):
        loss = model(torch.randn(4, 32, device=fabric.device)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        hdet.step(loss)
    hdet.finish()
    fabric.save(path, {"model": model, "hdet": hdet})
    return len(hdet.history)


def check_hdet_fabric(args: argparse.Namespace, out: Path) -> str:
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="hdet_spawn")
    rows = fabric.launch(_fabric_loop, out / "fabric.ckpt")
    return f"{rows} vote rows, checkpoint {(out / 'fabric.ckpt').stat().st_size} bytes"


CHECKS: dict[str, Callable[[argparse.Namespace, Path], str]] = {
    "hdet (Trainer, checkpoint, resume)": check_hdet_trainer,
    "diloco (Trainer)": check_diloco_trainer,
    "hdet (Fabric, HDETLoop, fabric.save)": check_hdet_fabric,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--devices", type=int, default=2, help="processes (at least 2: HDET needs groups)")
    args = parser.parse_args(argv)
    print(f"lightning-hdet {lightning_hdet.__version__}, lightning {lightning.__version__}, torch {torch.__version__}, "
          f"python {sys.version.split()[0]}, {args.devices} x {args.accelerator}")
    failed = 0
    for name, check in CHECKS.items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                print(f"PASS {name}: {check(args, Path(tmp))}", flush=True)
            except Exception:  # report every check, then the status says whether any failed
                failed += 1
                print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print("all checks passed" if not failed else f"{failed} of {len(CHECKS)} checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
