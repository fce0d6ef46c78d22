"""lightning-hdet: hyperparameter-divergent ensemble training and asynchronous Local-SGD for Lightning."""

__version__ = "0.1.0.dev0"
