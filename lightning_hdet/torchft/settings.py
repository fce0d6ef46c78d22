"""Where a job finds torchft's Lighthouse, how many jobs a round needs, and how long anything may wait.

torchft is imported only in :meth:`TorchFT.connect` (an optional extra: ``pip install lightning-hdet[torchft]``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional

from lightning_hdet._checks import KnownArguments, check_int, check_number, require
from lightning_hdet.torchft.rounds import require_supported

TORCHFT_MISSING = ("TorchFT needs the torchft package: `pip install lightning-hdet[torchft]` (or `pip install "
                   "torchft`).")


@dataclass(frozen=True)
class TorchFT(KnownArguments):
    """torchft as the fault-tolerance engine of DiLoCo across jobs (see :class:`~.strategy.TorchFTStrategy`).

    Each Lightning job (one node, any number of ranks) is one torchft *replica group*; the Lighthouse forms a quorum
    of the live jobs at the start of every round, and again (shrink-only) before its allreduce.

    Args:
        lighthouse: the Lighthouse's address, ``"http://HOST:PORT"`` (``torchft_lighthouse --bind [::]:PORT``).
        min_replicas: jobs a round needs; with fewer live a job waits at the quorum, up to ``quorum_timeout``.
        replica_id: this job's name in the quorum (torchft adds a unique suffix); ``None``: the host and process id.
        timeout: seconds a round's allreduce, its commit vote or a heal's transfer may take (a job frozen inside
            the allreduce stalls the others this long; one frozen between allreduces, the heartbeat timeout), and
            that a job waits for the quorum at a round's end: one left out of it (later than the Lighthouse's join
            timeout) discards its round then and heals at the next round's start.
        quorum_timeout: seconds a job waits at a round's start for the quorum: longer than a round of the slowest
            job (the live jobs meet there) and than the time a new job takes to start.
        connect_timeout: seconds to reach the Lighthouse and the job's own torchft manager.
        hostname: the name other jobs reach this job's manager at (heals are served from it); ``None``: this host's.
        heartbeat_s: seconds between this job's heartbeats to the Lighthouse: a few times below its heartbeat
            timeout (``--heartbeat_timeout_ms``, 5 s by default). A beat costs the job ~0.3 ms of CPU: torchft's own
            0.1 s ~3 ms a second, 0.5 s ~0.6 ms, 1 s ~0.35 ms. A longer interval never delays noticing a frozen job
            (the Lighthouse drops it once its last beat is the timeout old), but a live job whose beats are delayed
            (a loaded host) is taken for dead sooner.
        max_discarded_rounds: rounds in a row this job did not commit, whatever the cause (a peer failing during
            one, a quorum smaller than ``min_replicas``, this job left out of its end: later than the Lighthouse's
            join timeout there), after which the job ends with an error instead of training for nothing.
    """

    lighthouse: str
    min_replicas: int
    replica_id: Optional[str] = None
    timeout: float = 60.0
    quorum_timeout: float = 900.0
    connect_timeout: float = 60.0
    hostname: Optional[str] = None
    max_discarded_rounds: int = 10
    heartbeat_s: float = 0.5

    def __post_init__(self) -> None:
        require("lighthouse", self.lighthouse, isinstance(self.lighthouse, str) and "://" in self.lighthouse,
                "an address 'http://HOST:PORT'", "torchft_lighthouse prints it as 'Lighthouse listening on: ...'.")
        check_int("min_replicas", self.min_replicas, minimum=1,
                  hint="A round needs this many live jobs; 1 lets a lone job go on.")
        check_int("max_discarded_rounds", self.max_discarded_rounds, minimum=1)
        for name in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_s"):
            check_number(name, getattr(self, name), low=0, low_open=True, hint="In seconds.")
        for name in ("replica_id", "hostname"):
            value = getattr(self, name)
            require(name, value, value is None or (isinstance(value, str) and bool(value)), "a non-empty str or None")

    def connect(self, rank: int, world_size: int, store_addr: str, store_port: int) -> Any:
        """This rank's torchft ``Manager`` (rank 0 of the job also runs the job's manager server), over the job's
        own TCPStore (at ``store_addr``, which the other jobs must reach), with a synchronous quorum; refused (and
        shut down) where the installed torchft's Manager lacks what a round relies on
        (:func:`~.rounds.require_supported`)."""
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError as error:
            raise ImportError(TORCHFT_MISSING) from error
        timeout = timedelta(seconds=self.timeout)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
            min_replica_size=self.min_replicas, use_async_quorum=False,  # DiLoCo: the quorum at the round's start
            timeout=timeout, quorum_timeout=timedelta(seconds=self.quorum_timeout),
            connect_timeout=timedelta(seconds=self.connect_timeout),
            heartbeat_interval=timedelta(seconds=self.heartbeat_s), rank=rank, world_size=world_size,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=self.lighthouse,
            replica_id=self.replica_id or f"{socket.gethostname()}_{os.getpid()}",
            max_retries=None,  # max_discarded_rounds counts every discarded round, left out or not committed
            hostname=self.hostname or socket.gethostname())
        try:
            require_supported(manager, _installed_version())
        except RuntimeError:
            manager.shutdown(wait=False)
            raise
        return manager


def _installed_version() -> str:
    try:
        return version("torchft")
    except PackageNotFoundError:  # e.g. torchft-nightly, which installs the same package under another name
        return "of an unknown version"
