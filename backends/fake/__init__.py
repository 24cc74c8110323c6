"""In-tree plugin: the CPU simulator backend ``fake``. Registered like any third-party plugin."""

from offload_core.device.hookspecs import hookimpl

from .backend import FakeBackend
from .memory import FakeOutOfMemoryError
from .sanitizer import StreamRaceError, UnseenWriteError
from .streams import StreamError

__all__ = ["FakeBackend", "FakeOutOfMemoryError", "StreamError", "StreamRaceError", "UnseenWriteError"]


@hookimpl
def offload_core_register_backends(register):
    register(FakeBackend)
