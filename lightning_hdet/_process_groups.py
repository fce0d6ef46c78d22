"""Releasing the process groups our strategies create: each one at the end of the trainer entry that created it,
and the default group when the interpreter exits.

Why it matters: a gloo group still alive while the interpreter finalizes can abort a process that has finished
its work ("terminate called without an active exception", SIGABRT): its native threads are destroyed in no
particular order with the rest of the process. Groups left from earlier trainer entries make it likelier.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist


def destroy_groups(groups: Iterable[Any]) -> None:
    """Destroy each of ``groups`` that is still registered (``None``: a group this rank is not a member of)."""
    if not (dist.is_available() and dist.is_initialized()):
        return  # the default group's destruction destroyed every group with it
    from torch.distributed import distributed_c10d  # why: no public "is this group alive" test

    live = distributed_c10d._world.pg_map
    for group in groups:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER and group in live:
            dist.destroy_process_group(group)


def destroy_default_group_at_exit() -> None:
    """Destroy the default process group, and every group still built on it, when the interpreter exits (registered
    once per process, however many trainer entries; it then runs before Lightning's own exit handler).

    Lightning does it for NCCL only.
    """
    atexit.unregister(_destroy_default_group)
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
