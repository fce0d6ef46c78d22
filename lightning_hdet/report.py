"""``python -m lightning_hdet.report RUN [--out DIR]``: figures and a summary of a finished run.

The command line only; the package ``__init__`` does not import this module (so ``python -m`` runs it once,
without runpy's double-import warning). The work is done in :mod:`lightning_hdet.records.report`.
"""

from lightning_hdet.records.report import main

if __name__ == "__main__":
    main()
