import os

# Before torch is imported: OpenMP reads OMP_NUM_THREADS once, when torch loads it. Set later, the parent kept one
# thread per core while Lightning's fork launcher (which sets a child's threads only when the variable is unset) left
# the children on more than one; a child forked after the parent had used OpenMP's threads then hung in its first
# parallel op (GNU OpenMP is not fork-safe), e.g. a BatchNorm forward after an earlier test's big tensors.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's process group gets a new free port (Lightning keeps MASTER_PORT in the environment once set),
    and no global seed an earlier test set: Lightning's launchers re-apply PL_GLOBAL_SEED in every rank."""
    for name in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "PL_GLOBAL_SEED",
                 "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> None:
    """Each test starts without a default process group. A single-process Trainer run earlier in this pytest
    process leaves Lightning's gloo group alive (Lightning destroys it at teardown only for NCCL); a forked rank
    would inherit it, and some tests assert that a strategy itself creates none."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
