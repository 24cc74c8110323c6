"""Capabilities of a simulated device: what a backend such as the fake offers so that tests can
make it strict (chaos, a race sanitizer) or limited (a memory cap, a bandwidth) and read its own
record of the work (a trace).

They sit here, beside the pytest plugin and the conformance kit that use them, not in
:class:`offload_core.Capability`: the library never asks for them. A backend lists them in its
``capabilities`` like any other name; each promises the constructor option or attribute named
below.
"""

from __future__ import annotations


class SimulatorCapability:
    """Names of the simulator features the plugin and the kit switch on or test."""

    #: ``chaos=True``: queued work is delayed and copy destinations are poisoned until written
    CHAOS = "chaos"
    #: ``device_memory=N``: a device-memory cap; exceeding it raises ``torch.OutOfMemoryError``
    CAPACITY = "capacity"
    #: ``h2d_bandwidth=B``: a host-to-device copy of n bytes takes at least n / B seconds
    BANDWIDTH = "bandwidth"
    #: a ``timeline`` with ``spans()`` and ``clear()`` (copies named "H2D"/"D2H" on their stream,
    #: host-blocking waits named "wait <stream>" on "default") and ``export_chrome_trace(path)``
    TRACE = "trace"
    #: ``sanitize=True``: accesses to the backend's memory from streams that no event orders, and
    #: buffers dropped while work touching them may still run, raise an error naming both sides
    SANITIZE = "sanitize"
