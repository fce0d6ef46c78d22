"""One exchange carried out (no Lightning): a worker's push and pull, rank 0's server, overlap and workers of several
ranks, over a transport from :mod:`~lightning_hdet.asynchronous.wire`."""
