"""One exchange carried out (no Lightning): push, pull, rank 0's server, overlap, workers of several ranks."""
