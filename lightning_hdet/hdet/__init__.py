"""HDET: groups of data-parallel replicas at different learning rates that vote and blend.

One folder per layer (docs/architecture.md; tests/test_layout.py checks each folder's imports):

* :mod:`~lightning_hdet.hdet.rules`: what a vote decides, each rule one object (pure);
* :mod:`~lightning_hdet.hdet.execution`: the decisions carried out on every group's parameters, optimizers and
  learning rates, over an injected communicator (no Lightning);
* :mod:`~lightning_hdet.hdet.lightning`: the callback, the DDP strategy and the glue to Lightning;
* :mod:`~lightning_hdet.hdet.fsdp`: the sharded strategy (``"hdet_fsdp"``).

The modules beside them (layout, multipliers, explored hyperparameters, parameter averages, the result) are pure
and used by several layers.
"""
