"""Lightning Fabric strategies on the same core as the Trainer's: ``Fabric(strategy="hdet")`` with
:class:`~lightning_hdet.fabric.loop.HDETLoop` for the votes, ``"async_local_sgd"`` and ``"diloco"``.

Importing :mod:`lightning_hdet` registers the names in ``lightning.fabric``'s strategy registry (see ``docs/fabric.md``).
"""

from lightning_hdet.fabric.asynchronous import AsyncLocalSGDFabricStrategy
from lightning_hdet.fabric.hdet import HDETFabricStrategy
from lightning_hdet.fabric.loop import HDETLoop

__all__ = ["AsyncLocalSGDFabricStrategy", "HDETFabricStrategy", "HDETLoop"]
