"""HDET's decisions carried out (no Lightning; tests/test_layout.py checks the folder): merges, the restore point
and roll-backs, the learning rates, the non-finite step guard and the validation swap, over the injected
:class:`~lightning_hdet.hdet.execution.comm.Communicator`, handed to the callback as one
:class:`~lightning_hdet.hdet.execution.executor.HDETParts`; :mod:`~lightning_hdet.hdet.execution.fake` runs the same
objects over memory."""
