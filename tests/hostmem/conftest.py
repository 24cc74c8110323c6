import pytest

from offload_core.hostmem import staging
from vendor import vendor_backend  # noqa: F401 (the stand-in vendor backend of tests/backends, a fixture)


@pytest.fixture
def kib_chunks(monkeypatch):
    """Bounce buffers of 4 KiB: each block of the tiny models takes several chunks, and the ring
    wraps within a block."""
    monkeypatch.setattr(staging, "BOUNCE_CHUNK_BYTES", 4096)
