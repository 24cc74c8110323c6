"""acme-offload: the offload-core backend for Acme accelerators.

Acme hardware is imaginary, so this example simulates it with the fake backend's machinery (worker
threads as streams, memory accounting, chaos mode); everything else, the class attributes, the
probe and the registration, is what a real plugin writes.
"""

from __future__ import annotations

import os

from offload_core import hookimpl
from offload_core_fake import FakeBackend


class AcmeBackend(FakeBackend):
    """Acme devices. A real backend implements every ``DeviceBackend`` method on its runtime."""

    name = "acme"  # what users pass to get_backend() and pytest --backend
    is_accelerator = True  # real hardware: auto-detection prefers it to in-tree backends
    priority = 10  # orders it among other available third-party accelerators
    dist_backend = "gloo"  # the torch.distributed backend its collectives use
    # device_type and capabilities are the simulator's: "cpu"; chaos, capacity, bandwidth,
    # trace, collectives, sanitize.

    @classmethod
    def probe(cls) -> bool:
        # Cheap, and initialises nothing: no device context, no runtime import (it may run
        # before a fork). A real plugin checks e.g. that a device node exists. The variable
        # lets a user hide the backend; by default the simulated device is always present.
        return os.environ.get("ACME_VISIBLE_DEVICES", "0") != ""


@hookimpl
def offload_core_register_backends(register):
    register(AcmeBackend)
