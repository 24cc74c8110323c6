import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

# One intra-op thread: the fake backend's copy threads get the other core, and outputs compared
# with torch.equal are computed with the same thread count throughout the run.
torch.set_num_threads(1)
