import subprocess
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DDPStrategy

from lightning_hdet.demos import CharCorpusDataModule, CharLM, load_corpus
from lightning_hdet.demos.corpus import stdlib_dir

from tests.helpers import START

SMALL = 60_000


def test_corpus_is_the_stdlib_bytes_in_walk_order():
    corpus = load_corpus(SMALL)
    first = (stdlib_dir() / corpus.files[0]).read_bytes()
    n = min(len(first), 1000)
    assert bytes(corpus.train[:n].tolist()) == first[:n]
    top_level = [f for f in corpus.files if "/" not in f]
    assert top_level == sorted(top_level) and len(top_level) > 1
    assert all(f.endswith(".py") and "site-packages" not in f for f in corpus.files)


def test_split_sizes_and_vocab():
    corpus = load_corpus(SMALL, val_fraction=0.1)
    assert corpus.num_chars == SMALL
    assert corpus.val.numel() == SMALL // 10
    assert corpus.train.numel() == SMALL - SMALL // 10
    assert corpus.train.dtype == torch.uint8
    assert CharCorpusDataModule.vocab_size == 256


def test_corpus_is_deterministic_across_processes():
    corpus = load_corpus.__wrapped__(SMALL)
    again = load_corpus.__wrapped__(SMALL)
    assert torch.equal(corpus.train, again.train) and torch.equal(corpus.val, again.val)
    code = f"from lightning_hdet.demos.corpus import load_corpus; print(load_corpus({SMALL}).fingerprint)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == corpus.fingerprint


def test_blocks_shapes_and_shift():
    dm = CharCorpusDataModule(block_size=32, batch_size=4, max_chars=SMALL)
    dm.setup("fit")
    assert len(dm.train_set) == (dm.corpus.train.numel() - 1) // 32
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    vx, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(vx[0], dm.corpus.val[:32].long())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"block_size": 0}, "block_size"), ({"batch_size": -1}, "batch_size")],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CharCorpusDataModule(**kwargs)


def test_bad_budget_and_split():
    with pytest.raises(ValueError, match="max_chars"):
        load_corpus(10**12)
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(SMALL, val_fraction=1.0)


class _FirstBatch(Callback):
    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            torch.save(batch[0], self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.timeout(180)
def test_ranks_get_different_shards(tmp_path):
    dm = CharCorpusDataModule(block_size=16, batch_size=8, max_chars=SMALL)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(start_method=START, process_group_backend="gloo"),
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_FirstBatch(tmp_path)],
    )
    trainer.fit(CharLM(block_size=16, d_model=16, n_layers=1, n_heads=2), dm)
    b0, b1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert b0.shape == b1.shape == (8, 16)
    rows0, rows1 = {tuple(r.tolist()) for r in b0}, {tuple(r.tolist()) for r in b1}
    assert not rows0 & rows1
