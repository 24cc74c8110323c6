"""A zoo of tiny, randomly initialised models for testing offloading without downloads or accelerators.

- :data:`PIPELINES` / :func:`build_pipeline`: real diffusers pipelines of the supported-model table
  (``docs/models.md``) with tiny components; :meth:`TinyPipeline.run` makes one seeded call. :data:`DEMOS`:
  pipelines built to show offloading (the default of ``offload-core run``).
- :data:`TRANSFORMERS` / :func:`build_transformer`: their denoisers alone, with inputs for one forward pass and
  the names of the block lists (``nn.ModuleList`` attributes) each class really has in diffusers 0.42.1.
- :data:`STANDINS` / :func:`build_standin`: architectures diffusers does not ship, as small modules with the
  upstream class names and topology.
- :mod:`offload_core.tiny.sweep` (``SWEEP`` / ``build_sweep_pipeline``): diffusers pipeline classes beyond the
  supported table, for the pipeline sweep.

Everything is built in code (tokenizers included), in float32 on the CPU, deterministically from a seed.
Importing this package imports neither diffusers nor transformers; building a model does.

Outputs are bit-identical across runs and processes for a fixed ``torch.get_num_threads()`` (the thread count
changes reduction order). The models are so small that intra-op threads only cost: on a busy two-core machine
``torch.set_num_threads(1)`` makes them about five times faster.
"""

from .pipelines import DEMOS, PIPELINES, PipelineSpec, TinyPipeline, as_tensor, build_pipeline, run
from .standins import STANDINS, build_standin
from .transformers import TRANSFORMERS, TinySpec, build_transformer

__all__ = [
    "DEMOS",
    "PIPELINES",
    "STANDINS",
    "TRANSFORMERS",
    "PipelineSpec",
    "TinyPipeline",
    "TinySpec",
    "as_tensor",
    "build_pipeline",
    "build_standin",
    "build_transformer",
    "run",
]
