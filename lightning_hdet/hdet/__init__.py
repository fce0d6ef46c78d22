"""HDET: groups of data-parallel replicas at different learning rates that vote and blend."""
