"""An offline, deterministic text corpus: the Python standard library's own source files.

Every machine with Python has it, so benchmarks and examples need no download. The corpus is the
concatenation of the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``,
``dist-packages`` and ``__pycache__`` excluded), visited depth first with the entries of each directory
sorted by name, cut at ``max_chars`` bytes. Tokens are raw bytes (vocabulary of 256), so no vocabulary
has to be built or stored and every process derives identical tensors from the same interpreter.
The first ``1 - val_fraction`` of the bytes is the training split, the rest the validation split.

The text depends on the interpreter version (its stdlib); :attr:`CharCorpus.fingerprint` identifies it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_hdet.demos.base import check_shard_train, check_shuffle_seed, training_loader

VOCAB_SIZE = 256
DEFAULT_MAX_CHARS = 1_000_000
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_dir() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path):
    """Yield the ``.py`` files under ``root`` depth first, names sorted at every level."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.name.startswith(".") or entry.name in _EXCLUDED_DIRS:
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _source_files(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


@dataclass(frozen=True)
class CharCorpus:
    """The corpus as byte tensors: ``train`` and ``val`` (``torch.uint8``), the files used and a hash."""

    train: Tensor
    val: Tensor
    files: tuple[str, ...]
    fingerprint: str

    @property
    def num_chars(self) -> int:
        return self.train.numel() + self.val.numel()


@lru_cache(maxsize=4)
def load_corpus(
    max_chars: int = DEFAULT_MAX_CHARS, val_fraction: float = 0.1, root: str | None = None
) -> CharCorpus:
    """Read the first ``max_chars`` bytes of the stdlib sources (``root`` overrides the directory).

    The last ``val_fraction`` of them form the validation split. Cached per process; nothing is written
    to disk.
    """
    if not isinstance(max_chars, int) or max_chars < 2:
        raise ValueError(f"max_chars must be an int >= 2, got {max_chars!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    base = Path(root) if root is not None else stdlib_dir()
    chunks: list[bytes] = []
    files: list[str] = []
    remaining = max_chars
    for path in _source_files(base):
        data = path.read_bytes()[:remaining]
        chunks.append(data)
        files.append(path.relative_to(base).as_posix())
        remaining -= len(data)
        if remaining == 0:
            break
    text = b"".join(chunks)
    if len(text) < max_chars:
        raise ValueError(
            f"max_chars={max_chars} exceeds the {len(text)} bytes of Python sources under {base}"
        )
    n_val = max(1, int(len(text) * val_fraction))
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    fingerprint = hashlib.sha256(text).hexdigest()[:16]
    return CharCorpus(tokens[:-n_val], tokens[-n_val:], tuple(files), fingerprint)


class BlockDataset(Dataset):
    """Non-overlapping blocks of a token stream: item ``i`` is ``(x, y)`` with ``y`` = ``x`` shifted by one."""

    def __init__(self, tokens: Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"block_size={block_size} needs at least {block_size + 1} tokens, the split has {tokens.numel()}"
            )
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class CharCorpusDataModule(LightningDataModule):
    """Byte-level language-modelling batches from the stdlib corpus.

    Every rank builds the same corpus; under DDP Lightning's ``DistributedSampler`` shards the shuffled
    training blocks, so ranks see different data. Validation blocks are not shuffled.

    Args:
        block_size: tokens per training example.
        batch_size: examples per batch (per process).
        max_chars: corpus size in bytes, taken from the start of the stdlib walk.
        val_fraction: share of the bytes, at the end, held out for validation.
        num_workers: ``DataLoader`` worker processes.
        root: read ``.py`` files from this directory instead of the stdlib (tests, other corpora).
        shuffle_seed: a fixed training order (see :func:`~lightning_hdet.demos.base.shuffle_generator`); ``None``:
            it follows the global seed.
        shard_train: each rank reads its own shard of the training blocks and the whole validation set (see
            :func:`~lightning_hdet.demos.base.training_loader`; use with ``use_distributed_sampler=False``).
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        max_chars: int = DEFAULT_MAX_CHARS,
        val_fraction: float = 0.1,
        num_workers: int = 0,
        root: str | None = None,
        shuffle_seed: int | None = None,
        shard_train: bool = False,
    ) -> None:
        super().__init__()
        check_shuffle_seed(shuffle_seed)
        check_shard_train(shard_train)
        self.shuffle_seed = shuffle_seed
        self.shard_train = shard_train
        for name, value in (("block_size", block_size), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.root = root
        self.corpus: CharCorpus | None = None

    def setup(self, stage: str | None = None) -> None:
        self.corpus = load_corpus(self.max_chars, self.val_fraction, self.root)
        self.train_set = BlockDataset(self.corpus.train, self.block_size)
        self.val_set = BlockDataset(self.corpus.val, self.block_size)

    def train_dataloader(self) -> DataLoader:
        return training_loader(
            self.train_set, self.batch_size, self.shuffle_seed, self.shard_train, self.trainer, self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
