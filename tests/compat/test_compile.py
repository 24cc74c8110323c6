"""torch.compile with offloading (docs/compatibility.md, the torch.compile rows): regional
compilation and the whole model compiled, before or after ``enable_offload``, give the compiled
model's outputs exactly, with no graph added by offload and none per step; ``fullgraph=True`` on a
streamed model is refused at its first call. Each check is a cell of the table: the model-level
and layerwise cells run here, the distributed ones in test_compatibility.py's two processes."""

from __future__ import annotations

import pytest

from compile_cases import CASES
from helpers import chaos_backend
from tools.compatibility import cells

#: the table is a statement about the fake backend (chaos mode, its sanitizer, CPU references)
pytestmark = pytest.mark.fake_only

SINGLE = [cell for cell in cells(("model", "layerwise")) if cell[0] in CASES]


@pytest.mark.parametrize("case,strategy,verdict", SINGLE, ids=[f"{c}-{s}" for c, s, _ in SINGLE])
def test_cell(case, strategy, verdict):
    CASES[case](strategy, chaos_backend(), verdict)
