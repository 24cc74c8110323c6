"""docs/models.md is generated from the block registry and the tested rows; it must not go stale."""

from __future__ import annotations

import pathlib

from offload_core.tiny import PIPELINES

from denoisers import TRANSFORMERS
from standins import STANDINS
from tools.supported_models import ROWS, render

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_doc_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/models.md is stale: run `python tools/supported_models.py > docs/models.md`"
    )


def test_every_row_is_tested_and_every_tiny_model_belongs_to_a_row():
    pipelines = {row.tiny_pipeline for row in ROWS if row.tiny_pipeline}
    models = {name for row in ROWS for name in row.tiny_models}
    assert pipelines == set(PIPELINES)
    assert models == set(TRANSFORMERS) | set(STANDINS)
    assert all(row.layerwise for row in ROWS), "every row of docs/models.md has at least a layerwise test"
