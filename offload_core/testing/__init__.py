"""The pytest plugin (``--backend``) and the backend conformance kit.

Run the kit for any registered backend with::

    pytest --backend=NAME --pyargs offload_core.testing

Each ``test_*.py`` module checks one part of the :class:`offload_core.DeviceBackend` contract;
``kit.py`` holds the helpers they share. See ``docs/backends.md``.
"""

from .capabilities import SimulatorCapability

__all__ = ["SimulatorCapability"]
