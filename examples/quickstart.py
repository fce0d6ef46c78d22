"""`make demo`: one HDET run on several CPU processes on a real corpus, then a table of votes and plots.

The corpus is the Python standard library's own source code (bytes), so nothing is downloaded. Four groups
start at learning rates spread over 30x (a "bad first guess" included); every ``--every`` steps they vote on
their validation loss (the run reads its data more than once) and the worst group continues from the winner's
model at a new LR; after a quarter of the run every group trains from the winner's model at LRs 1.5x apart.

    python examples/quickstart.py                 # 4 processes, under a minute on 2 idle CPU cores
    python examples/quickstart.py --wandb         # also log to W&B (`wandb login` first, or WANDB_MODE=offline)
    python examples/quickstart.py --accelerator gpu --devices 8 --steps 2000   # on GPUs
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, Logger

from lightning_hdet import HDETCallback, HDETStrategy
from lightning_hdet.demos import CharCorpusDataModule, CharLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4, help="processes (one per GPU on GPUs)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--every", type=int, default=25, help="steps between votes")
    parser.add_argument("--lr", type=float, default=3e-3, help="base learning rate of the model's AdamW")
    parser.add_argument("--multipliers", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0],
                        help="one learning-rate multiplier per group (their count must divide --devices)")
    parser.add_argument("--vote", choices=("pbt", "softmax", "best"), default="pbt")
    parser.add_argument("--max-chars", type=int, default=400_000, help="corpus size in bytes")
    parser.add_argument("--out", type=Path, default=Path("out/demo"))
    parser.add_argument("--wandb", action="store_true",
                        help="also log to W&B (after `wandb login`, or with WANDB_MODE=offline)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(0)
    csv_logger = CSVLogger(save_dir=args.out, name="hdet")
    loggers: list[Logger] = [csv_logger]
    if args.wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project="lightning-hdet-demo", save_dir=str(args.out), group="quickstart",
                                   job_type="hdet"))
    hdet = HDETCallback(every_n_steps=args.every, vote=args.vote)
    trainer = Trainer(
        strategy=HDETStrategy(lr_multipliers=args.multipliers, gradient_sync="group"),
        accelerator=args.accelerator,
        devices=args.devices,
        max_steps=args.steps,
        val_check_interval=args.every,
        limit_val_batches=8,
        check_val_every_n_epoch=None,
        # The data module shards the training data itself and every rank validates the same batches, so the merged
        # model's loss printed below is the same on every rank (HDET's votes compare the groups on the same data
        # with Lightning's own sampler too: it splits a fit's validation over each group's ranks).
        use_distributed_sampler=False,
        callbacks=[hdet],
        logger=loggers,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = CharLM(lr=args.lr)
    data = CharCorpusDataModule(block_size=64, batch_size=16, max_chars=args.max_chars, shard_train=True)
    trainer.fit(model, datamodule=data)
    merged = trainer.validate(model, datamodule=data, verbose=False)  # every rank now holds the merged model
    if trainer.is_global_zero:
        report(trainer, hdet, csv_logger, merged[0]["val_loss"])


def report(trainer: Trainer, hdet: HDETCallback, csv_logger: CSVLogger, val_loss: float) -> None:
    """Print what the ensemble found and write the figures."""
    print("\nHDET votes (trained at: the LR that reached the loss; lr after: the LR the vote set)")
    print(f"{'step':>5} {'group':>5} {'trained at':>10} {'loss':>8} {'lr after':>10} {'weight':>7} {'winner':>6} "
          f"{'rescued':>7}")
    for row in hdet.history:
        print(f"{row['step']:>5} {row['group']:>5} {row['trained_lr']:>10.2e} {row['loss']:>8.4f} {row['lr']:>10.2e} "
              f"{row['weight']:>7.3f} {row['winner']:>6} {str(row['rescued']):>7}")
    groups = trainer.strategy.num_groups
    last = hdet.history[-groups:]
    winner = last[0]["winner"]
    start = ", ".join(f"{lr:.1e}" for lr in hdet.initial_lrs)
    end = ", ".join(f"{r['lr']:.1e}" for r in last)
    print(f"\nLearning rates: started at [{start}], ended at [{end}] (last winner: group {winner}).")
    print(f"Rescues: {hdet.rescues}. Final validation loss of the merged model: {val_loss:.4f}")
    csv_logger.save()
    print(plots(csv_logger.log_dir))
    print("\nNext: add HDET to your own script (docs/quickstart.md); what the plots show: docs/watching.md.")


def plots(log_dir: str) -> str:
    """Write the run's figures; their paths, or why there are none (matplotlib is the optional `plots` extra)."""
    from lightning_hdet.records import write_report

    try:
        paths = write_report(log_dir, Path(log_dir) / "plots")
    except ImportError as err:
        return f"\nPlots: none written ({err})."
    return "\nPlots:\n" + "\n".join(f"  {path}" for path in paths)


if __name__ == "__main__":
    main()
