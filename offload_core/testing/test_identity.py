"""Conformance: the backend describes itself consistently and its handles follow the protocols."""

from __future__ import annotations

import torch

from offload_core import Capability, DeviceBackend, Event, Stream, list_backends
from offload_core.testing import SimulatorCapability

KNOWN_CAPABILITIES = {v for names in (Capability, SimulatorCapability) for k, v in vars(names).items() if k.isupper()}


def test_backend_is_registered_under_its_name(backend, backend_name):
    """``--backend=NAME`` must give a backend whose ``name`` is NAME, listed and available,
    else selection by name and auto-detection disagree about what they picked."""
    assert isinstance(backend, DeviceBackend)
    assert backend.name == backend_name
    listed = {info.name: info for info in list_backends()}
    assert listed[backend_name].cls is type(backend)
    assert listed[backend_name].available, "probe() is False for the backend under test"


def test_class_attributes_are_consistent(backend):
    """Strategies allocate on ``device()`` and join process groups with ``dist_backend``."""
    assert backend.device().type == backend.device_type
    assert backend.device(0).type == backend.device_type
    assert backend.device_count() >= 1
    assert isinstance(backend.dist_backend, str) and backend.dist_backend
    assert isinstance(backend.priority, int)
    unknown = set(backend.capabilities) - KNOWN_CAPABILITIES
    assert not unknown, f"capabilities named by neither Capability nor SimulatorCapability: {sorted(unknown)}"


def test_streams_and_events_follow_the_protocols(backend):
    """Strategies rely only on the Stream / Event protocol methods."""
    stream = backend.new_stream()
    assert isinstance(stream, Stream)
    assert isinstance(backend.current_stream(), Stream)
    event = backend.new_event()
    assert isinstance(event, Event)
    event.record(stream)
    event.synchronize()
    assert event.query()


def test_close_is_idempotent(new_backend):
    """close() may be called by a handle, a fixture and atexit alike; it must not fail twice,
    and must not lose work that was already synchronised."""
    b = new_backend()
    stream = b.new_stream()
    src = b.empty_pinned(64, torch.float32)
    src.fill_(3)
    dst = b.empty_device(64, torch.float32)
    out = b.empty_pinned(64, torch.float32)
    b.copy_async(dst, src, stream)
    b.copy_async(out, dst, stream)
    stream.synchronize()
    b.close()
    b.close()
    assert torch.equal(out, torch.full((64,), 3.0))
