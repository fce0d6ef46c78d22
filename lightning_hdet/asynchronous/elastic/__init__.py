"""Workers that come and go: the outer optimizer as its own service, workers as Lightning jobs (one device, or
several ranks training as DDP)."""

from lightning_hdet.asynchronous.elastic.ddp import ElasticDDPWorkerStrategy
from lightning_hdet.asynchronous.elastic.service import OuterService
from lightning_hdet.asynchronous.elastic.strategy import ElasticWorkerStrategy

__all__ = ["ElasticDDPWorkerStrategy", "ElasticWorkerStrategy", "OuterService"]
