"""docs/compatibility.md: every cell of the table is a check that runs, and the file is generated
from the table. The checks are in compat_cases.py and, for torch.compile, compat/compile_cases.py,
whose model-level and layerwise cells test_compile.py runs; the other model-level and layerwise
cells run here, the whole distributed column on two gloo processes."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.multiprocessing as mp

from tools.compatibility import ROWS, cells, render

import compat_cases
import compile_cases
from helpers import chaos_backend, free_port

#: the table is a statement about the fake backend (chaos mode, its sanitizer, CPU references)
pytestmark = pytest.mark.fake_only

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
WORLD = 2
#: every row's check, in the table's order
CHECKS = {**compile_cases.CASES, **compat_cases.CASES}
SINGLE = [cell for cell in cells(("model", "layerwise")) if cell[0] in compat_cases.CASES]


@pytest.mark.parametrize("case,strategy,verdict", SINGLE, ids=[f"{c}-{s}" for c, s, _ in SINGLE])
def test_cell(case, strategy, verdict):
    compat_cases.CASES[case](strategy, chaos_backend(), verdict)


def _worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ helpers in the spawned process
    torch.set_num_threads(1)
    from helpers import chaos_backend

    backend = chaos_backend()
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    for case, strategy, verdict in cells(("distributed",)):
        try:
            CHECKS[case](strategy, backend, verdict)
        except BaseException as exc:
            raise AssertionError(f"rank {rank}, {case} ({verdict}): {exc}") from exc


def test_distributed_cells():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)


def test_every_row_has_its_check_and_the_doc_is_current():
    assert [row.case for row in ROWS] == list(CHECKS), "a row without a check, or a check without a row"
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/compatibility.md is stale: run `python tools/compatibility.py > docs/compatibility.md`"
    )
