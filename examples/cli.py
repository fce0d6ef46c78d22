"""LightningCLI with HDET: strategy and callback configured from YAML and the command line.

    python examples/cli.py fit --config examples/configs/hdet.yaml
    python examples/cli.py fit --config examples/configs/hdet.yaml --trainer.devices=4 \\
        --trainer.strategy.num_groups=4 --trainer.strategy.lr_multipliers='[1, 0.5, 0.1, 5]'
    python examples/cli.py fit --config examples/configs/hdet.yaml --print_config   # the resolved config

The model is the demo byte-level LM (``--model.*``), the data the stdlib corpus (``--data.*``).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_hdet  # noqa: F401  (registers strategy="hdet"; class_path works without it too)
from lightning_hdet.demos import CharCorpusDataModule, CharLM


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """``args``/``run`` as in ``LightningCLI``: the tests build the configured objects without training."""
    return LightningCLI(
        CharLM, CharCorpusDataModule, args=args, run=run, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
