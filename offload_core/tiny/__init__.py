"""Tiny, randomly initialised diffusers pipelines built in code: the embedded demos of ``offload-core run`` and
the pipelines ``offload-core bench`` times, with no download and no accelerator.

- :data:`PIPELINES` / :func:`build_pipeline`: real diffusers pipelines of the supported-model table
  (``docs/models.md``) with tiny components; :meth:`TinyPipeline.run` makes one seeded call. :data:`DEMOS`:
  pipelines built to show offloading (the default of ``offload-core run``).
The test suite's own models live in ``tests/``: the same denoisers alone, with inputs for one forward pass
(``denoisers.py``), stand-ins for architectures diffusers does not ship (``standins.py``) and the pipeline
sweep (``sweep/``).

Everything is built in code (tokenizers included), in float32 on the CPU, deterministically from a seed.
Importing this package imports neither diffusers nor transformers; building a model does.

Outputs are bit-identical across runs and processes for a fixed ``torch.get_num_threads()`` (the thread count
changes reduction order). The models are so small that intra-op threads only cost: on a busy two-core machine
``torch.set_num_threads(1)`` makes them about five times faster.
"""

from .zoo import DEMOS, PIPELINES, build_pipeline
from .spec import PipelineSpec, TinyPipeline, as_tensor, run

__all__ = [
    "DEMOS",
    "PIPELINES",
    "PipelineSpec",
    "TinyPipeline",
    "as_tensor",
    "build_pipeline",
    "run",
]
