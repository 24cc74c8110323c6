import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# One intra-op thread: the fake backend's copy threads get the other core, and outputs compared
# with torch.equal are computed with the same thread count throughout the run.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def flux2():
    """The tiny FLUX.2 pipeline and its output without offload, shared by a test module's tests."""
    from offload_core.tiny import build_pipeline

    tiny = build_pipeline("flux2")
    tiny.expected = tiny.run(seed=0)
    return tiny
