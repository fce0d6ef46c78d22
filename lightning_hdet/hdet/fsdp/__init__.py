"""HDET over sharded groups (``strategy="hdet_fsdp"``, FSDP2): the strategy, merges of local shards, the shards'
gradient mean and the checkpoint folders."""
