"""lightning-hdet: hyperparameter-divergent ensemble training and asynchronous Local-SGD for Lightning.

Importing the package registers ``Trainer(strategy="hdet")`` and ``"hdet_spawn"``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hdet.blend import blend_coefficients
from lightning_hdet.callback import HDETCallback
from lightning_hdet.fanout import fan_out
from lightning_hdet.strategy import HDETStrategy
from lightning_hdet.vote import BestVote, SoftmaxVote

__version__ = "0.1.0.dev0"

__all__ = ["BestVote", "HDETCallback", "HDETStrategy", "SoftmaxVote", "blend_coefficients", "fan_out"]

HDETStrategy.register_strategies(StrategyRegistry)
