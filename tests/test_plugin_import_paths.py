"""Plugins written for 0.1 import ``offload_core.backend``, ``offload_core.accelerator`` and
``offload_core.hookspecs`` (the paths docs/backends.md gave them); those modules now live in
``offload_core/device/``. The old paths must keep giving the very same objects, or a plugin's
``DeviceBackend`` subclass would be a class the registry does not accept and its ``hookimpl`` a
marker pluggy does not see."""

from __future__ import annotations

import importlib

import pytest

import offload_core

MOVED = {
    "offload_core.backend": "offload_core.device.backend",
    "offload_core.accelerator": "offload_core.device.accelerator",
    "offload_core.hookspecs": "offload_core.device.hookspecs",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_paths_plugins_use_give_the_device_layers_objects(old):
    before, now = importlib.import_module(old), importlib.import_module(MOVED[old])
    assert before.__all__ == now.__all__
    for name in now.__all__:
        assert getattr(before, name) is getattr(now, name), name


def test_the_top_level_names_are_the_device_layers():
    from offload_core.device import accelerator, backend, hookspecs, plugins

    assert offload_core.AcceleratorBackend is accelerator.AcceleratorBackend
    assert offload_core.DeviceBackend is backend.DeviceBackend
    assert offload_core.hookimpl is hookspecs.hookimpl
    assert offload_core.get_backend is plugins.get_backend
