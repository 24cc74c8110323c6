"""Finding what to offload: block stacks in a model, components in a pipeline."""

from ..base.errors import BlockDiscoveryError
from . import known_models  # noqa: F401  (registers the supported-model table)
from .blocks import declared_attrs, find_blocks, register_blocks, registered_blocks

__all__ = ["BlockDiscoveryError", "declared_attrs", "find_blocks", "register_blocks", "registered_blocks"]
