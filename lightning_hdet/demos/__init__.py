"""Real, offline workloads for examples, tests and benchmarks: a byte-level corpus and a small causal LM, and
procedurally generated images with a small conv net, and generated tabular data with an MLP."""

from lightning_hdet.demos.char_lm import CharLM
from lightning_hdet.demos.corpus import CharCorpus, CharCorpusDataModule, load_corpus
from lightning_hdet.demos.shapes import ShapesCNN, ShapesDataModule, make_shapes
from lightning_hdet.demos.tabular import TabularDataModule, TabularMLP, make_tabular

__all__ = ["CharCorpus", "CharCorpusDataModule", "CharLM", "ShapesCNN", "ShapesDataModule", "TabularDataModule", "TabularMLP", "load_corpus",
           "make_shapes", "make_tabular"]
