"""Markers for tests whose expectation depends on the Lightning release (the suite also runs on the lowest one,
``make test-lowest``). Not in helpers.py: subprocesses import that one to check that a checkpoint loads without
lightning_hdet."""

from __future__ import annotations

import pytest

from lightning_hdet._compat import CHECKPOINT_NAMED_BY_RANK_ZERO

# Lightning < 2.6 lets each rank name its checkpoint files itself: a lagging async worker names its own file apart
# and resumes from rank 0's inner state (warned; docs/quickstart.md, "Supported versions"). The tests that check
# every worker's own file run on the lowest supported Lightning as expected failures.
NEEDS_RANK_ZERO_CHECKPOINT_NAMES = pytest.mark.xfail(
    not CHECKPOINT_NAMED_BY_RANK_ZERO, strict=False,
    reason="Lightning < 2.6: ModelCheckpoint names files on every rank, a lagging worker's own file is named apart")
