import pytest
from offload_core.tiny import build_pipeline

from helpers import pipeline_reference
from tools.supported_models import ROWS

#: the supported table's tiny pipelines that model-level offload runs (layerwise runs them too)
NAMES = [row.tiny_pipeline for row in ROWS if row.model_level]


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    """A tiny pipeline and its output without offload, built once per test module."""
    tiny = build_pipeline(request.param)
    tiny.expected = pipeline_reference(tiny)
    return tiny
