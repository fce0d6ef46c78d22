"""Real, offline workloads for examples, tests and benchmarks: a byte-level corpus and a small causal LM."""

from lightning_hdet.demos.char_lm import CharLM
from lightning_hdet.demos.corpus import CharCorpus, CharCorpusDataModule, load_corpus

__all__ = ["CharCorpus", "CharCorpusDataModule", "CharLM", "load_corpus"]
