"""lightning-hdet: hyperparameter-divergent ensemble training and asynchronous Local-SGD for Lightning."""

__version__ = "0.1.0.dev0"

# --- asynchronous Local-SGD / DiLoCo (issue 4) ---
from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry  # noqa: E402

from lightning_hdet.async_local_sgd import AsyncLocalSGDStrategy  # noqa: E402
from lightning_hdet.delayed_nesterov import DelayedNesterov  # noqa: E402
from lightning_hdet.local_steps import LocalStepsPolicy, dynamic_local_steps  # noqa: E402
from lightning_hdet.testing import SlowRanks  # noqa: E402

__all__ = ["AsyncLocalSGDStrategy", "DelayedNesterov", "LocalStepsPolicy", "SlowRanks", "dynamic_local_steps"]
AsyncLocalSGDStrategy.register_strategies(_StrategyRegistry)
# --- end asynchronous Local-SGD ---
