"""Layer 3: other libraries acting on an offloaded target: their hooks, which offload runs under
and which it refuses (``other_hooks.py``), and diffusers' layerwise casting, whose casts offload
takes over (``casting.py``, which also gives ``storage_dtype=`` its casting)."""
