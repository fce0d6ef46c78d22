"""The outer side, pure (no Lightning, no process groups): the outer optimizer (Delayed Nesterov and its momentum
schedule, SparseLoCo's round), the push checks, the local-step policy and rank 0's outer state."""
