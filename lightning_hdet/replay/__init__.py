"""Replaying what an HDET run found: its winning learning-rate trajectory, in a plain run."""

from lightning_hdet.replay.callback import HDETReplay
from lightning_hdet.replay.trajectory import LRTrajectory, ReplayHooks

__all__ = ["HDETReplay", "LRTrajectory", "ReplayHooks"]
