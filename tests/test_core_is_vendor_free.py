"""The core never names a vendor module (docs/design.md): strategies reach devices only through a
backend, so offload_core imports and runs on machines without CUDA or torch_npu, and a new
vendor needs no change to it. Vendor code belongs in backends/."""

from __future__ import annotations

import re
from pathlib import Path

import offload_core

CORE = Path(offload_core.__file__).resolve().parent
VENDOR = re.compile(r"torch\.cuda|torch\.npu|torch_npu")


def test_core_sources_name_no_vendor_module():
    offenders = [
        f"{path.relative_to(CORE.parent)}:{lineno}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if VENDOR.search(line)
    ]
    assert not offenders, "vendor modules named in offload_core/:\n" + "\n".join(offenders)


def test_the_scan_sees_the_core():
    """Guard against a vacuous pass: the scan must find the core's modules."""
    names = {p.name for p in CORE.rglob("*.py")}
    assert {"backend.py", "plugins.py", "hookspecs.py"} <= names
    assert VENDOR.search("x = torch.cuda.Stream()") and VENDOR.search("import torch_npu")
