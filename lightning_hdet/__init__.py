"""lightning-hdet: hyperparameter-divergent ensemble training and asynchronous Local-SGD for Lightning.

Importing the package registers ``Trainer(strategy=...)`` names: ``"hdet"``, ``"hdet_spawn"``, ``"hdet_published"``,
``"hdet_fsdp"``, ``"async_local_sgd"``, ``"async_local_sgd_spawn"``, ``"diloco"`` and ``"diloco_spawn"``; and
``Fabric(strategy=...)`` names: ``"hdet"``, ``"async_local_sgd"``, ``"diloco"`` (each also with ``_spawn`` and ``_fork``).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hdet.asynchronous.elastic import ElasticDDPWorkerStrategy, ElasticWorkerStrategy, OuterService
from lightning_hdet.asynchronous.lightning.strategy import AsyncLocalSGDStrategy
from lightning_hdet.asynchronous.lightning.worker_shape import WorkerShape
from lightning_hdet.asynchronous.outer.checks import PushCheck
from lightning_hdet.asynchronous.outer.delayed_nesterov import DelayedNesterov, DelayedNesterovOptimizer, Nesterov
from lightning_hdet.asynchronous.outer.local_steps import AdaptiveSteps, LocalStepsPolicy, dynamic_local_steps
from lightning_hdet.asynchronous.outer.lookahead import LookaheadLR
from lightning_hdet.asynchronous.outer.sparseloco import SparseLoCo
from lightning_hdet.asynchronous.wire.codecs import BF16, Int8, NoCodec, TopK
from lightning_hdet.asynchronous.wire.network import PointToPoint, Transport
from lightning_hdet.fabric import AsyncLocalSGDFabricStrategy, HDETFabricStrategy, HDETLoop
from lightning_hdet.hdet.fsdp.strategy import HDETFSDPStrategy
from lightning_hdet.hdet.layout import fan_out
from lightning_hdet.hdet.lightning.callback import HDETCallback
from lightning_hdet.hdet.lightning.strategy import HDETStrategy
from lightning_hdet.hdet.rules.blends import blend_coefficients
from lightning_hdet.hdet.rules.options import PBT, Best, SafetyNet, Search, Softmax, TrustRegion
from lightning_hdet.hdet.rules.plateau import PlateauRule
from lightning_hdet.hdet.rules.votes import Ballot
from lightning_hdet.replay import HDETReplay, LRTrajectory
from lightning_hdet.testing import SlowLink, SlowRanks

__version__ = "0.1.0.dev0"

__all__ = [
    "AdaptiveSteps",
    "AsyncLocalSGDFabricStrategy",
    "AsyncLocalSGDStrategy",
    "BF16",
    "Ballot",
    "Best",
    "DelayedNesterov",
    "DelayedNesterovOptimizer",
    "ElasticDDPWorkerStrategy",
    "ElasticWorkerStrategy",
    "HDETCallback",
    "HDETFSDPStrategy",
    "HDETFabricStrategy",
    "HDETLoop",
    "HDETReplay",
    "LRTrajectory",
    "LookaheadLR",
    "HDETStrategy",
    "Int8",
    "LocalStepsPolicy",
    "Nesterov",
    "NoCodec",
    "OuterService",
    "PBT",
    "PlateauRule",
    "PointToPoint",
    "PushCheck",
    "SafetyNet",
    "Search",
    "SlowLink",
    "SlowRanks",
    "Softmax",
    "SparseLoCo",
    "TopK",
    "Transport",
    "TrustRegion",
    "WorkerShape",
    "blend_coefficients",
    "dynamic_local_steps",
    "fan_out",
]

HDETStrategy.register_strategies(StrategyRegistry)
HDETFSDPStrategy.register_strategies(StrategyRegistry)
AsyncLocalSGDStrategy.register_strategies(StrategyRegistry)
HDETFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
AsyncLocalSGDFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
