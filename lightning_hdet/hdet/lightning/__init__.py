"""HDET in Lightning: the callback that votes, the DDP strategy (``strategy="hdet"``) and what both strategies share
(process groups, the ensemble's checkpoints, metric sync, the module checks)."""
