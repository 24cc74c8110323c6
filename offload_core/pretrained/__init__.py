"""Layer 0 beside ``enable_offload``: ``offload_core.from_pretrained`` (``load.py``), which reads a
local folder's diffusers models (and, through ``encoders.py``, its transformers models) straight
into offloaded homes, every path it reads confined to the folder (``folder.py``)."""
