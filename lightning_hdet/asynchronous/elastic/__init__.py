"""Workers that come and go: the outer optimizer as its own service, workers as one-device Lightning jobs."""

from lightning_hdet.asynchronous.elastic.service import OuterService
from lightning_hdet.asynchronous.elastic.strategy import ElasticWorkerStrategy

__all__ = ["ElasticWorkerStrategy", "OuterService"]
