import os

import torch.multiprocessing

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Sandboxed CI machines reject the default fd-passing of shared CPU tensors to spawned workers.
torch.multiprocessing.set_sharing_strategy("file_system")
