"""HDET or plain DDP on the byte-level language model over the Python stdlib's source (no download).

The same model, data, step budget and base learning rate under ``--strategy hdet`` (groups at different
learning rates that vote and merge) or ``--strategy ddp`` (the baseline), so the two can be compared.
Prints one summary line and writes it to ``<out>/<strategy>/summary.json``.

    python examples/char_lm.py                          # HDET, 2 CPU processes, under 2 minutes
    python examples/char_lm.py --strategy ddp           # the DDP baseline with the same settings
    python examples/char_lm.py --accelerator gpu --devices 8 --groups 4 --steps 5000 --every 500 \\
        --d-model 256 --layers 4 --max-chars 20000000 --wandb   # scaled up
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, Logger

import lightning_hdet  # noqa: F401  (registers strategy="hdet")
from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.demos import CharCorpusDataModule, CharLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategy", choices=("hdet", "ddp"), default="hdet")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes (one per GPU on GPUs)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--groups", type=int, default=None, help="HDET groups (default: one per process)")
    parser.add_argument("--multipliers", type=float, nargs="+", default=None,
                        help="HDET: one learning-rate multiplier per group (default: [0.3, 3] for 2 groups)")
    parser.add_argument("--vote", choices=("pbt", "softmax", "best"), default="pbt")
    parser.add_argument("--every", type=int, default=20, help="HDET: steps between votes")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="base learning rate (AdamW)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--max-chars", type=int, default=200_000, help="corpus size in bytes")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed on GPUs")
    parser.add_argument("--out", type=Path, default=Path("out/char_lm"))
    parser.add_argument("--wandb", action="store_true",
                        help="also log to W&B (after `wandb login`, or with WANDB_MODE=offline)")
    return parser.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> HDETStrategy | str:
    if args.strategy == "ddp":
        return "ddp"
    multipliers = args.multipliers
    if multipliers is None and (args.groups or args.devices * args.num_nodes) == 2:
        multipliers = [0.3, 3.0]  # a deliberately bad first guess on either side of the base LR
    return HDETStrategy(num_groups=args.groups, lr_multipliers=multipliers, gradient_sync="group")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    seed_everything(0)
    loggers: list[Logger] = [CSVLogger(save_dir=args.out, name=args.strategy)]
    if args.wandb:
        from lightning.pytorch.loggers import WandbLogger

        # One W&B group for the comparison, one job type per strategy: the runs line up in the UI.
        loggers.append(WandbLogger(project="lightning-hdet-char-lm", save_dir=str(args.out), group="char_lm",
                                   job_type=args.strategy))
    callbacks = [HDETCallback(every_n_steps=args.every, vote=args.vote)] if args.strategy == "hdet" else []
    trainer = Trainer(
        strategy=make_strategy(args),
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        max_steps=args.steps,
        val_check_interval=args.every,
        check_val_every_n_epoch=None,
        limit_val_batches=8,
        callbacks=callbacks,
        logger=loggers,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = CharLM(lr=args.lr, d_model=args.d_model, n_layers=args.layers, block_size=args.block_size)
    data = CharCorpusDataModule(
        block_size=args.block_size, batch_size=args.batch_size, max_chars=args.max_chars
    )
    trainer.fit(model, datamodule=data)
    # Every rank holds the final (for HDET: merged) model, so a plain validation measures it.
    val_loss = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    summary = {"strategy": args.strategy, "steps": trainer.global_step, "val_loss": val_loss}
    if args.strategy == "hdet":
        summary["final_lrs"] = trainer.strategy.current_lrs()[:, 0].tolist()
        summary["votes"] = callbacks[0].num_votes
    if trainer.is_global_zero:
        out = args.out / args.strategy
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        lrs = [f"{lr:.1e}" for lr in summary.get("final_lrs", [])]
        print(f"\n{args.strategy}: {summary['steps']} steps, final model val_loss {val_loss:.4f}"
              + (f", group LRs {lrs}" if lrs else ""))
    return summary


if __name__ == "__main__":
    main()
