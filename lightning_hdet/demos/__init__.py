"""Real, offline workloads for examples, tests and benchmarks: a byte-level corpus and a small causal LM, and
procedurally generated images with a small conv net."""

from lightning_hdet.demos.char_lm import CharLM
from lightning_hdet.demos.corpus import CharCorpus, CharCorpusDataModule, load_corpus
from lightning_hdet.demos.shapes import ShapesCNN, ShapesDataModule, make_shapes

__all__ = ["CharCorpus", "CharCorpusDataModule", "CharLM", "ShapesCNN", "ShapesDataModule", "load_corpus", "make_shapes"]
