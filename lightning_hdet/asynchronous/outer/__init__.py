"""The outer side, pure: outer optimizers, SparseLoCo, push checks, local steps and the outer state."""
