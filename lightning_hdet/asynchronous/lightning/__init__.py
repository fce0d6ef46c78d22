"""Lightning glue: the strategy, its logging callback, every worker's checkpoints, workers' groups."""
