"""The device layer, the bottom of the library: the :class:`DeviceBackend` contract every strategy
is written against (``backend.py``), the generic accelerator on torch's device API that the CUDA,
NPU and XPU backends share (``accelerator.py``), the plugin hooks and the registry that finds
backends (``hookspecs.py``, ``plugins.py``), the ``torch.distributed`` calls they share across
torch versions (``collectives.py``) and the accounting of what they allocate
(``memory_accounting.py``). It imports nothing of the library but ``base/errors.py``.

The package imports none of its modules itself, so that a process importing one of them (the
registry, for ``offload-core backends``) pays only for what that one imports.
"""
