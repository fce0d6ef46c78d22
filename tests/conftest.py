import os

import pytest


os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _fresh_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's process group gets a new free port (Lightning keeps MASTER_PORT in the environment once set)."""
    for name in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
