"""DiLoCo across Lightning jobs with torchft as the fault-tolerance engine (``pip install lightning-hdet[torchft]``):
:class:`TorchFTStrategy` given a :class:`TorchFT`. See ``docs/elastic.md``, "DiLoCo on torchft"."""

from lightning_hdet.torchft.rounds import SplitBrainError
from lightning_hdet.torchft.settings import TorchFT
from lightning_hdet.torchft.strategy import TorchFTStrategy

__all__ = ["SplitBrainError", "TorchFT", "TorchFTStrategy"]
