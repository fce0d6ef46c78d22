"""Lightning glue: the strategy, its logging callback, checkpoints of every worker, and the process groups of
workers of several ranks."""
